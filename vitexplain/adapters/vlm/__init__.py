"""Adapters of vision-language models (VLMs), one module per model family; the
shared interface is in :mod:`~vitexplain.adapters.vlm.base`, the geometry of image tokens in
:mod:`~vitexplain.adapters.vlm.views` and their pixel-relevance sums in :mod:`~vitexplain.adapters.vlm.pixel_tokens`."""

from __future__ import annotations

from .base import VLMAdapter
from .views import ImageView, Piece, render

# each module registers its detector
from . import llava, llava_next, mistral3, internvl, paligemma, gemma4, qwen, idefics, lfm2, janus, perception_lm, molmo2, minicpmv, idefics2, fuyu, qformer, mllama, florence, pix2struct, unknown  # noqa: E402,F401

__all__ = ["ImageView", "Piece", "VLMAdapter", "render"]
