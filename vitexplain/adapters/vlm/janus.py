"""Janus, Janus-Pro and DeepSeek-VL (``JanusForConditionalGeneration``, ``DeepseekVLForConditionalGeneration``): the
whole image letterboxed into a square, one token per patch.

The image processor resizes the image so that its longer side is ``size`` (the shorter side rounded, at least
``min_size``), keeping its aspect ratio, then pads it to a square, centred, with the mean colour (``do_pad``).
The vision tower (SigLIP-like, no class token) cuts the square into ``patch_size`` patches; the aligner maps
each patch to one image token, row by row: a grid over the padded square, whose bands beyond the image hold
padding (no pixels of the image). The tokens sit between ``<begin_of_image>`` and ``<end_of_image>`` (not image
tokens). Janus' image-generation parts (its VQ-VAE and generation head) take no part in understanding. DeepSeek-VL
(its SigLIP tower) has the same processor and the same geometry, without ``<begin_of_image>`` / ``<end_of_image>``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .views import ImageView, Piece

__all__ = ["LetterboxAdapter", "letterbox_box"]


def letterbox_box(image_processor: Any, height: int, width: int, padded: tuple[int, int]) -> tuple[float, float, float, float]:
    """The box, in original pixels, that a ``padded`` (ph, pw) letterboxed image of an (H, W) original covers.

    Follows ``JanusImageProcessor`` (and DeepSeek-VL's): the longer side resized to ``size``, the other to
    ``max(round(side * size / longer), min_size)``, then the resized image centred in the padded one.
    """
    size = dict(getattr(image_processor, "size", None) or {})
    if not getattr(image_processor, "do_resize", True):
        rh, rw = height, width
    elif size.get("height") and size.get("height") == size.get("width"):
        scale = size["height"] / max(height, width)
        low = int(getattr(image_processor, "min_size", 0) or 0)
        rh, rw = max(round(height * scale), low), max(round(width * scale), low)
    else:
        raise UnsupportedModelError(f"cannot follow this image processor's resize (size={size}); it resizes to a square size")
    ph, pw = padded
    top, left = (ph - rh) // 2, (pw - rw) // 2
    sy, sx = height / rh, width / rw
    return (-top * sy, -left * sx, (ph - top) * sy, (pw - left) * sx)


class LetterboxAdapter(VLMAdapter):
    """``JanusForConditionalGeneration`` and ``DeepseekVLForConditionalGeneration`` (see the module docstring)."""

    image_token = "<image_placeholder>"

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        patch = int(self.model.config.vision_config.patch_size)
        ph, pw = (int(s) for s in inputs["pixel_values"].shape[-2:])
        grid = (ph // patch, pw // patch)
        views = []
        for b, image in enumerate(images):
            held = int((inputs["input_ids"][b] == self.image_token_id).sum())
            if grid[0] * grid[1] != held:
                raise UnsupportedModelError(
                    f"image {b}'s {ph} x {pw} pixels in {patch} px patches do not give its {held} image tokens; "
                    f"use the model's own {type(self.model).__name__.replace('ForConditionalGeneration', 'Processor')}")
            h, w = int(image.shape[0]), int(image.shape[1])
            box = letterbox_box(self.image_processor, h, w, (ph, pw))
            views.append(ImageView((h, w), (Piece("image", grid, box, 0),)))
        return views


@register_adapter(priority=20, family=VLM)
def _detect_letterbox(model: nn.Module) -> Optional[Adapter]:
    if type(model).__name__ in ("JanusForConditionalGeneration", "DeepseekVLForConditionalGeneration"):
        return LetterboxAdapter(model)
    return None
