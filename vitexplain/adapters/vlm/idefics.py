"""Idefics3 and SmolVLM: tiles plus a global image, pixel shuffle.

The processor resizes the image so that its sides are multiples of the tile size
(``max_image_size``) and cuts it into ``rows x cols`` tiles, row by row, then adds the whole image
resized to one tile (the global image, the "thumbnail"); a small image is the global image alone.
Each tile's patch grid is pixel-shuffled by ``scale_factor`` (s x s patches become one token), so a
tile gives a (g / s) x (g / s) grid of tokens, row-major. In the sequence the tiles come first, in
row-major order, then the global image; separator tokens (``<fake_token_around_image>``,
``<row_i_col_j>``, ``<global-img>``, newlines) carry no pixels. Tile (r, c) covers rows
``r/rows..(r+1)/rows`` and columns ``c/cols..(c+1)/cols`` of the original image (the whole image is
resized to the tiles), the global image covers all of it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter, processor_images
from .views import ImageView, Piece

__all__ = ["TiledAdapter"]


class TiledAdapter(VLMAdapter):
    """``Idefics3ForConditionalGeneration`` and ``SmolVLMForConditionalGeneration``."""

    nested_images = True

    def _tiles(self, image: Any) -> tuple[int, int]:
        """(rows, cols) of the processor's split of one image (0, 0: no split)."""
        info = self.image_processor(images=[processor_images([image])], return_row_col_info=True)
        return int(info["rows"][0][0]), int(info["cols"][0][0])

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        config = self.model.config
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        if side % config.scale_factor:
            raise UnsupportedModelError(f"a {side}x{side} patch grid cannot be pixel-shuffled by {config.scale_factor}")
        grid = (side // config.scale_factor, side // config.scale_factor)
        per_piece = grid[0] * grid[1]
        views = []
        for image in images:
            h, w = float(image.shape[0]), float(image.shape[1])
            rows, cols = self._tiles(image)
            pieces = [Piece(f"tile {r},{c}", grid, (r * h / rows, c * w / cols, (r + 1) * h / rows, (c + 1) * w / cols),
                            (r * cols + c) * per_piece) for r in range(rows) for c in range(cols)]
            name = "thumbnail" if pieces else "image"
            pieces.append(Piece(name, grid, (0.0, 0.0, h, w), rows * cols * per_piece))
            views.append(ImageView((int(h), int(w)), tuple(pieces)))
        return views


@register_adapter(priority=20, family=VLM)
def _detect_tiled(model: nn.Module) -> Optional[Adapter]:
    if type(model).__name__ in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"):
        return TiledAdapter(model)
    return None
