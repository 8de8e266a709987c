"""Adapters of vision-language models (VLMs), one module per model family; the
shared geometry and interface are in :mod:`~vitexplain.adapters.vlm.base`."""

from __future__ import annotations

from .base import ImageView, Piece, VLMAdapter, render

from . import llava, llava_next, paligemma, qwen, idefics, qformer, florence, pix2struct, refused  # noqa: E402,F401  (registers its detector)
from . import mllama  # noqa: E402,F401  (cross-attention layers: registers its detector)

__all__ = ["ImageView", "Piece", "VLMAdapter", "render"]
