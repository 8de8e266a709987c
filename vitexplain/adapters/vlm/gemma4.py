"""Gemma 4 (``Gemma4ForConditionalGeneration``): native aspect ratio, patches pooled k x k, bidirectional image blocks.

The processor resizes the whole image (no crop), keeping its aspect ratio, to the largest size within the
patch budget (``max_soft_tokens * k^2`` patches) whose sides are multiples of ``patch_size * k`` (``k`` =
``pooling_kernel_size``), and hands the model the patches themselves (``pixel_values`` (B, max_patches,
p^2 C)) with their (x, y) positions (``image_position_ids``, -1 for padding). The vision tower's output is
average-pooled over k x k blocks of patches by position, so the language model sees one image token per
block, row by row: a grid of (rows / k, cols / k) tokens over the whole original image. The image tokens sit
between ``boi`` and ``eoi`` tokens (not image tokens). ``mm_token_type_ids`` mark them, and models with
``use_bidirectional_attention="vision"`` let each image's tokens attend to each other both ways: the
processor must give them, and the teacher-forced answer tokens are text (0), as for ``generate``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .views import ImageView, Piece

__all__ = ["Gemma4Adapter"]


class Gemma4Adapter(VLMAdapter):
    """``Gemma4ForConditionalGeneration`` (see the module docstring)."""

    image_token = "<|image|>"
    nested_images = True
    required_inputs = ("mm_token_type_ids", "image_position_ids")
    required_for = "(the patches' positions, and which tokens are the image's for its mask)"
    answer_values = {"mm_token_type_ids": 0}  # the answer is text

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        k = int(self.model.config.vision_config.pooling_kernel_size)
        positions = inputs["image_position_ids"]
        if positions.shape[0] != len(images):
            raise UnsupportedModelError(f"{positions.shape[0]} images' patch positions for {len(images)} images")
        views = []
        for b, image in enumerate(images):
            real = positions[b][(positions[b] >= 0).all(dim=-1)]  # (n, 2) as (x, y), in patches
            cols, rows = (int(real[:, 0].max()) + 1, int(real[:, 1].max()) + 1) if real.numel() else (0, 0)
            grid = (rows // k, cols // k)
            held = int((inputs["input_ids"][b] == self.image_token_id).sum())
            if grid[0] * grid[1] != held or rows % k or cols % k:
                raise UnsupportedModelError(
                    f"image {b}'s {rows} x {cols} patches pooled {k} x {k} do not give its {held} image tokens; "
                    "use the model's own Gemma4Processor with its pooling_kernel_size")
            h, w = int(image.shape[0]), int(image.shape[1])
            views.append(ImageView((h, w), (Piece("image", grid, (0.0, 0.0, float(h), float(w)), 0),)))
        return views


@register_adapter(priority=20, family=VLM)
def _detect_gemma4(model: nn.Module) -> Optional[Adapter]:
    return Gemma4Adapter(model) if type(model).__name__ == "Gemma4ForConditionalGeneration" else None
