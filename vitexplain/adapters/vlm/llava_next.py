"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``): a thumbnail plus any-resolution tiles.

The processor picks the best of ``image_grid_pinpoints`` for the image, resizes the image into it
keeping the aspect ratio, pads it centred, and cuts it into ``image_size`` tiles; it also resizes the
whole image to one tile (the thumbnail, "base"). The model puts the thumbnail's patch grid first,
then stitches the tiles' patch grids into one grid, removes the rows (or columns) that are padding
("unpad", computed from the original size) and appends a newline token after every row. So the
image's tokens are: the g x g thumbnail grid, row-major, then H_u rows of W_u patch tokens each
followed by one newline token (no pixels). The stitched grid covers the unpadded part of the
canvas, mapped back to the original image through the resize and the padding offset.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from torch import nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import ImageView, Piece, VLMAdapter

__all__ = ["LlavaNextAdapter", "anyres_view"]


def _best_resolution(size: tuple[int, int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """transformers' ``select_best_resolution``: the (h, w) that keeps the most image pixels, then wastes the least."""
    from transformers.image_processing_utils import select_best_resolution

    return tuple(int(v) for v in select_best_resolution(size, [list(p) for p in pinpoints]))  # type: ignore[return-value]


def anyres_view(height: int, width: int, tile: int, patch: int, pinpoints: Sequence[Sequence[int]]) -> ImageView:
    """The token geometry of one image (see the module docstring)."""
    grid = tile // patch
    bh, bw = _best_resolution((height, width), pinpoints)
    rows, cols = bh // tile, bw // tile
    scale_w, scale_h = bw / width, bh / height  # the processor's resize into the canvas (get_patch_output_size)
    if scale_w < scale_h:
        new_h, new_w = min(math.ceil(height * scale_w), bh), bw
    else:
        new_h, new_w = bh, min(math.ceil(width * scale_h), bw)
    paste_y, paste_x = (bh - new_h) // 2, (bw - new_w) // 2
    cur_h, cur_w = rows * grid, cols * grid  # the stitched patch grid, then the model's unpad
    pad_r = pad_c = 0
    if width / height > cur_w / cur_h:
        pad_r = (cur_h - int(round(height * (cur_w / width), 7))) // 2
    else:
        pad_c = (cur_w - int(round(width * (cur_h / height), 7))) // 2
    h_u, w_u = cur_h - 2 * pad_r, cur_w - 2 * pad_c
    box = ((pad_r * patch - paste_y) * height / new_h, (pad_c * patch - paste_x) * width / new_w,
           ((cur_h - pad_r) * patch - paste_y) * height / new_h, ((cur_w - pad_c) * patch - paste_x) * width / new_w)
    base = grid * grid
    newlines = tuple(base + r * (w_u + 1) + w_u for r in range(h_u))
    pieces = (Piece("thumbnail", (grid, grid), (0.0, 0.0, float(height), float(width)), 0),
              Piece("tiles", (h_u, w_u), box, base))
    return ImageView((height, width), pieces, newlines)


class LlavaNextAdapter(VLMAdapter):
    """LLaVA-NeXT (LLaVA-1.6) with the ``default`` feature strategy (class token dropped)."""

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        config = self.model.config
        if config.vision_feature_select_strategy != "default":
            raise UnsupportedModelError("LLaVA-NeXT with the 'full' feature strategy is not supported")
        tile, patch = config.vision_config.image_size, config.vision_config.patch_size
        processor = self.processor.image_processor
        crop = dict(getattr(processor, "crop_size", None) or {})
        if crop and crop.get("height") != tile:
            raise UnsupportedModelError(f"the processor's {crop} tiles differ from the vision tower's {tile} px input")
        return [anyres_view(int(image.shape[0]), int(image.shape[1]), tile, patch, config.image_grid_pinpoints)
                for image in images]


@register_adapter(priority=20, family=VLM)
def _detect_llava_next(model: nn.Module) -> Optional[Adapter]:
    return LlavaNextAdapter(model) if type(model).__name__ == "LlavaNextForConditionalGeneration" else None
