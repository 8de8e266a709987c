"""LLaVA-NeXT and LLaVA-OneVision: a thumbnail plus any-resolution tiles.

The processor picks the best of ``image_grid_pinpoints`` for the image, resizes the image into it
keeping the aspect ratio, pads it centred, and cuts it into ``image_size`` tiles; it also resizes the
whole image to one tile (the thumbnail, "base"). The model puts the thumbnail's patch grid first,
then stitches the tiles' patch grids into one grid, removes the rows (or columns) that are padding
("unpad", computed from the original size) and appends a newline token after every row. So the
image's tokens are: the g x g thumbnail grid, row-major, then H_u rows of W_u patch tokens each
followed by one newline token (no pixels). The stitched grid covers the unpadded part of the
canvas, mapped back to the original image through the resize and the padding offset.
LLaVA-OneVision does the same and then, when the stitched grid holds more than ``anyres_max_N``
tiles' worth of patches, interpolates it down (bilinear) to a coarser grid over the same region.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from torch import nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .views import ImageView, Piece

__all__ = ["LlavaNextAdapter", "anyres_view"]


def _best_resolution(size: tuple[int, int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """transformers' ``select_best_resolution``: the (h, w) that keeps the most image pixels, then wastes the least."""
    from transformers.image_processing_utils import select_best_resolution

    return tuple(int(v) for v in select_best_resolution(size, [list(p) for p in pinpoints]))  # type: ignore[return-value]


def anyres_view(height: int, width: int, tile: int, patch: int, pinpoints: Sequence[Sequence[int]],
                max_tiles: Optional[int] = None) -> ImageView:
    """The token geometry of one image (see the module docstring); ``max_tiles``: OneVision's
    ``anyres_max_N``, above which the unpadded grid is interpolated down (bilinear) to about N tiles."""
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
    grid_u = (h_u, w_u)
    if max_tiles is not None:
        ratio = math.sqrt(h_u * w_u / (max_tiles * grid**2))
        if ratio > 1.1:  # the model's own rule (LlavaOnevisionModel.pack_image_features)
            grid_u = (int(h_u // ratio), int(w_u // ratio))
    box = ((pad_r * patch - paste_y) * height / new_h, (pad_c * patch - paste_x) * width / new_w,
           ((cur_h - pad_r) * patch - paste_y) * height / new_h, ((cur_w - pad_c) * patch - paste_x) * width / new_w)
    base = grid * grid
    newlines = tuple(base + r * (grid_u[1] + 1) + grid_u[1] for r in range(grid_u[0]))
    pieces = (Piece("thumbnail", (grid, grid), (0.0, 0.0, float(height), float(width)), 0),
              Piece("tiles", grid_u, box, base))
    return ImageView((height, width), pieces, newlines)


class LlavaNextAdapter(VLMAdapter):
    """LLaVA-NeXT (LLaVA-1.6) and LLaVA-OneVision (``onevision=True``: the stitched grid may be
    interpolated down, ``vision_aspect_ratio="anyres_max_N"``)."""

    def __init__(self, model: nn.Module, processor: Any = None, onevision: bool = False) -> None:
        super().__init__(model, processor)
        self.onevision = onevision

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        config = self.model.config
        tile, patch = config.vision_config.image_size, config.vision_config.patch_size
        max_tiles = None
        if self.onevision:
            aspect = str(config.vision_aspect_ratio)
            if not aspect.startswith("anyres_max_"):
                raise UnsupportedModelError(f"LLaVA-OneVision with vision_aspect_ratio={aspect!r} is not supported")
            max_tiles = int(aspect[len("anyres_max_"):])
        elif config.vision_feature_select_strategy != "default":
            raise UnsupportedModelError("LLaVA-NeXT with the 'full' feature strategy (a class token per tile) is not supported")
        processor = self.image_processor
        crop = dict(getattr(processor, "crop_size", None) or {})
        if crop and crop.get("height") != tile:
            raise UnsupportedModelError(f"the processor's {crop} tiles differ from the vision tower's {tile} px input")
        cuts = getattr(processor, "image_grid_pinpoints", None)  # (the processor cuts by its own, the model stitches by its)
        if cuts is not None and [list(p) for p in cuts] != [list(p) for p in config.image_grid_pinpoints]:
            raise UnsupportedModelError(
                f"the processor cuts tiles by image_grid_pinpoints {[list(p) for p in cuts]}, but the model stitches them "
                f"back by its config's {[list(p) for p in config.image_grid_pinpoints]}; use the model's own processor "
                "settings (no image_grid_pinpoints in processor_kwargs)")
        return [anyres_view(int(image.shape[0]), int(image.shape[1]), tile, patch, config.image_grid_pinpoints, max_tiles)
                for image in images]


@register_adapter(priority=20, family=VLM)
def _detect_llava_next(model: nn.Module) -> Optional[Adapter]:
    name = type(model).__name__
    if name in ("LlavaNextForConditionalGeneration", "LlavaNextVideoForConditionalGeneration"):  # (Video: its images)
        return LlavaNextAdapter(model)
    if name == "LlavaOnevisionForConditionalGeneration":
        return LlavaNextAdapter(model, onevision=True)
    return None
