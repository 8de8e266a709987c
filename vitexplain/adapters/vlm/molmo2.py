"""Molmo2 (``Molmo2ForConditionalGeneration``): a low-resolution view, then overlapping crops stitched back into one
high-resolution grid; patches attention-pooled in blocks.

The image processor gives each image two views: the whole image resized to one ``size`` square (the low-resolution
view, its aspect ratio bent), and the whole image resized to a canvas of ``tiling_h x tiling_w`` overlapping crops
(``compute_crop_geometry``: windows of ``size`` less the ``overlap_margins``, plus the margins). Each crop's patches
inside its margins (the outer margins at the canvas' edge kept) tile the canvas exactly once, so the crops' patches
form one patch grid over the canvas. Each view's patch grid is cut into ``pooling_size`` blocks, padded with empty
slots (centred, the odd one after) to whole blocks, and each block becomes one token by attention pooling over its
own patches (``image_token_pooling``): the low-resolution view's tokens, then the canvas', row-major
(``image_grids``), ``<im_col>`` after each row and ``<im_start>`` / ``<im_end>`` around each view carrying no pixels.
Every image token attends to every other (one bidirectional block from ``mm_token_type_ids``): the processor must
give them, and the teacher-forced answer tokens are text (0), as for ``generate``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .views import ImageView, Piece

__all__ = ["Molmo2Adapter"]


def _pooled_box(patches: int, pool: int, pixels: float, scale: float) -> tuple[float, float]:
    """(low, high) in original pixels of ``patches`` patches of ``pixels`` px padded to whole ``pool`` blocks (the
    smaller half of the padding first), a resized pixel being ``scale`` original ones."""
    pad = -patches % pool
    low = -(pad // 2)
    return low * pixels * scale, (patches + low + pad) * pixels * scale


class Molmo2Adapter(VLMAdapter):
    """``Molmo2ForConditionalGeneration`` (see the module docstring)."""

    image_token = "<|image|>"
    required_inputs = ("mm_token_type_ids", "image_grids", "image_token_pooling")
    required_for = "(which tokens form its bidirectional image block, each view's token grid and each token's patches)"
    answer_values = {"mm_token_type_ids": 0}  # the answer is text

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        from transformers.models.molmo2.image_processing_molmo2 import compute_crop_geometry

        processor = self.image_processor
        size = dict(processor.size)
        crop, patch = int(size["height"]), int(processor.patch_size)
        pool_h, pool_w = (int(p) for p in processor.pooling_size)
        grids = inputs["image_grids"].tolist()
        if len(grids) != len(images) or size["width"] != crop:
            raise UnsupportedModelError(f"{len(grids)} image grids for {len(images)} images of a {size} processor; use the "
                                        "model's own Molmo2Processor")
        views = []
        for b, (image, grid) in enumerate(zip(images, grids)):
            h, w = int(image.shape[0]), int(image.shape[1])
            _, _, canvas_h, canvas_w = compute_crop_geometry(h, w, max_crops=int(processor.max_crops),
                                                             overlap_margins=list(processor.overlap_margins),
                                                             crop_size=crop, patch_size=patch)
            low = (*_pooled_box(crop // patch, pool_h, patch, h / crop), *_pooled_box(crop // patch, pool_w, patch, w / crop))
            high = (*_pooled_box(canvas_h // patch, pool_h, patch, h / canvas_h),
                    *_pooled_box(canvas_w // patch, pool_w, patch, w / canvas_w))
            low_grid, high_grid = (int(grid[0]), int(grid[1])), (int(grid[2]), int(grid[3]))
            expected = (-(-(crop // patch) // pool_h), -(-(crop // patch) // pool_w),
                        -(-(canvas_h // patch) // pool_h), -(-(canvas_w // patch) // pool_w))
            held = int((inputs["input_ids"][b] == self.image_token_id).sum())
            if tuple(grid) != expected or held != low_grid[0] * low_grid[1] + high_grid[0] * high_grid[1]:
                raise UnsupportedModelError(
                    f"image {b}'s token grids {grid} (the processor's) and {held} image tokens do not match its crop "
                    f"geometry {expected}; use the model's own Molmo2Processor, with the settings it was called with")
            views.append(ImageView((h, w), (
                Piece("thumbnail", low_grid, (low[0], low[2], low[1], low[3]), 0),
                Piece("image", high_grid, (high[0], high[2], high[1], high[3]), low_grid[0] * low_grid[1]))))
        return views


@register_adapter(priority=20, family=VLM)
def _detect_molmo2(model: nn.Module) -> Optional[Adapter]:
    return Molmo2Adapter(model) if type(model).__name__ == "Molmo2ForConditionalGeneration" else None
