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

from torch import Tensor, nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter, processor_images
from .pixel_tokens import piece_tokens
from .views import ImageView, Piece

__all__ = ["TiledAdapter"]


class TiledAdapter(VLMAdapter):
    """``Idefics3ForConditionalGeneration`` and ``SmolVLMForConditionalGeneration``."""

    nested_images = True

    def _tiles(self, image: Any) -> tuple[int, int]:
        """(rows, cols) of the processor's split of one image (0, 0: no split)."""
        info = self.image_processor(images=[processor_images([image])], return_row_col_info=True)
        return int(info["rows"][0][0]), int(info["cols"][0][0])

    def _grid(self) -> tuple[int, int]:
        """(gh, gw) tokens of one piece: its patch grid pixel-shuffled by ``scale_factor``.

        Raises:
            UnsupportedModelError: the patch grid is not a whole number of shuffle blocks.
        """
        config = self.model.config
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        if side % config.scale_factor:
            raise UnsupportedModelError(f"a {side}x{side} patch grid cannot be pixel-shuffled by {config.scale_factor}")
        return side // config.scale_factor, side // config.scale_factor

    def lrp_pixels(self, kwargs: Any) -> str:
        """The processor's pieces (``pixel_values``, (B, P, C, H, W): the tiles row by row, then the global image;
        all-zero padding pieces, which the model drops)."""
        if "pixel_values" not in kwargs or kwargs["pixel_values"].dim() != 5:
            raise UnsupportedModelError(f"the teacher-forced forward of {type(self.model).__name__} holds no (B, P, C, H, W) "
                                        "pixel_values of tiles; use the model's own processor")
        return "pixel_values"

    def lrp_tokens(self, relevance: Tensor, counts: Sequence[int], inputs: Any = None) -> list[Tensor]:
        """Per image, (T, n_b) relevance of its tokens from (B, T, P, H, W) relevance at its pieces' pixels: each token
        sums the pixels of its s x s block of patches (the pixel shuffle), pieces in the sequence's order (the
        processor's); the batch's padding pieces, which the model drops, are left out (their pixels are 0).

        Raises:
            UnsupportedModelError: an image's tokens are not a whole number of pieces held in its pixels.
        """
        grid, what = self._grid(), type(self.model).__name__
        return [piece_tokens(relevance[b], n, grid, what, b) for b, n in enumerate(counts)]

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        grid = self._grid()
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
        adapter = TiledAdapter(model)
        adapter.capabilities = adapter.capabilities | {"lrp"}  # (checked against a hand-written oracle)
        adapter.notes.pop("lrp", None)
        return adapter
    return None
