"""InternVL (``InternVLForConditionalGeneration``, InternVL 2.5 / 3 in transformers), Aya Vision and Command A
Vision (Cohere2Vision): tiles plus a thumbnail, pixel shuffle.

The image processor (``GotOcr2ImageProcessor``), with ``crop_to_patches``, picks the ``rows x cols`` canvas
of tiles closest to the image's aspect ratio within ``min_patches..max_patches``
(``get_optimal_tiled_canvas``), resizes the whole image to it and cuts the tiles row by row, then adds the
whole image resized to one tile (the thumbnail) when there is more than one tile; without
``crop_to_patches`` the image is one tile. Each tile's patch grid (the tower's class token dropped) is
pixel-shuffled by ``downsample_ratio`` (each token a block of ``1 / ratio`` x ``1 / ratio`` patches,
row-major), and its tokens stand between ``<img>`` and ``</img>``, tiles first, then the thumbnail.
Tile (r, c) covers rows ``r/rows..(r+1)/rows`` and columns ``c/cols..(c+1)/cols`` of the original image.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

from torch import Tensor, nn

from ...errors import UnsupportedModelError
from ...layout import pair
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .pixel_tokens import batch_piece_tokens
from .views import ImageView, Piece

__all__ = ["InternVLAdapter", "AyaVisionAdapter", "Cohere2VisionAdapter", "QianfanOCRAdapter"]


class InternVLAdapter(VLMAdapter):
    """``InternVLForConditionalGeneration`` (see the module docstring)."""

    image_token = "<IMG_CONTEXT>"

    def _tiles(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of the image processor's tiling of an (H, W) image ((1, 1): one tile)."""
        processor = self.image_processor
        if not getattr(processor, "crop_to_patches", False):
            return 1, 1
        # the tiling processor's own canvas search (GotOcr2's, or Cohere2Vision's other one)
        get_optimal_tiled_canvas = getattr(sys.modules.get(type(processor).__module__), "get_optimal_tiled_canvas", None)
        if get_optimal_tiled_canvas is None:
            raise UnsupportedModelError(f"{type(processor).__name__} tiles images in a way vitexplain does not follow")
        size = processor.size
        cols, rows = get_optimal_tiled_canvas((height, width), (size["height"], size["width"]),
                                              processor.min_patches, processor.max_patches)
        return int(rows), int(cols)

    def _grid(self) -> tuple[int, int]:
        """The token grid of one tile: its patch grid (class token dropped) pixel-shuffled."""
        config = self.model.config
        side = [s // p for s, p in zip(pair(config.vision_config.image_size), pair(config.vision_config.patch_size))]
        ratio = float(config.downsample_ratio)
        grid = (int(side[0] * ratio), int(side[1] * ratio))
        if config.vision_feature_select_strategy != "default" or grid[0] / ratio != side[0] or grid[1] / ratio != side[1]:
            raise UnsupportedModelError(
                f"InternVL with vision_feature_select_strategy={config.vision_feature_select_strategy!r} and a "
                f"{side[0]}x{side[1]} patch grid shuffled by {ratio}: its image tokens' geometry is not followed")
        return grid

    def lrp_pixels(self, kwargs: Any) -> str:
        """The processor's pieces (``pixel_values``, (P, C, H, W): each image's tiles row by row, then its thumbnail,
        images one after another)."""
        if "pixel_values" not in kwargs or kwargs["pixel_values"].dim() != 4:
            raise UnsupportedModelError(f"the teacher-forced forward of {type(self.model).__name__} holds no (P, C, H, W) "
                                        "pixel_values of tiles; use the model's own processor")
        return "pixel_values"

    def lrp_tokens(self, relevance: Tensor, counts: Sequence[int], inputs: Any = None) -> list[Tensor]:
        """Per image, (T, n_b) relevance of its tokens from (P, T, H, W) relevance at the batch's pieces' pixels: each
        token sums the pixels of its block of patches (the pixel shuffle, row-major blocks), the pieces taken in order,
        ``n_b / tokens per piece`` for image b.

        Raises:
            UnsupportedModelError: the tokens are not whole pieces, or not as many pieces as the pixels hold.
        """
        return batch_piece_tokens(relevance, counts, self._grid(), type(self.model).__name__)

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        grid = self._grid()
        per_piece = grid[0] * grid[1]
        views = []
        for image in images:
            h, w = int(image.shape[0]), int(image.shape[1])
            rows, cols = self._tiles(h, w)
            pieces = [Piece(f"tile {r},{c}", grid, (r * h / rows, c * w / cols, (r + 1) * h / rows, (c + 1) * w / cols),
                            (r * cols + c) * per_piece) for r in range(rows) for c in range(cols)]
            if len(pieces) > 1:  # (the processor adds the thumbnail to a tiled image only)
                pieces.append(Piece("thumbnail", grid, (0.0, 0.0, float(h), float(w)), rows * cols * per_piece))
            else:
                pieces = [Piece("image", grid, (0.0, 0.0, float(h), float(w)), 0)]
            views.append(ImageView((h, w), tuple(pieces)))
        return views


class AyaVisionAdapter(InternVLAdapter):
    """Aya Vision (``AyaVisionForConditionalGeneration``): InternVL's tiles and thumbnail (GotOcr2's tiling; the
    tiles, each after its ``TILE_i`` token, then the thumbnail after ``TILE_GLOBAL``), a SigLIP tower (no class
    token) pixel-shuffled by ``downsample_factor``."""

    image_token = "<image>"

    def _grid(self) -> tuple[int, int]:
        config = self.model.config
        side = [s // p for s, p in zip(pair(config.vision_config.image_size), pair(config.vision_config.patch_size))]
        factor = int(config.downsample_factor)
        strategy = getattr(config, "vision_feature_select_strategy", "full")  # (Cohere2Vision: every token)
        if strategy != "full" or side[0] % factor or side[1] % factor:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} with vision_feature_select_strategy={strategy!r} and a "
                f"{side[0]}x{side[1]} patch grid shuffled by {factor}: its image tokens' geometry is not followed")
        return side[0] // factor, side[1] // factor


class Cohere2VisionAdapter(AyaVisionAdapter):
    """Command A Vision (``Cohere2VisionForConditionalGeneration``): Aya Vision's geometry, its own canvas search
    (``Cohere2VisionImageProcessor``); each tile's tokens end with a line-break token (no pixels)."""


class QianfanOCRAdapter(InternVLAdapter):
    """Qianfan-OCR (``QianfanOCRForConditionalGeneration``): InternVL's tower, tiles and thumbnail; its processor expands
    an ``<image>`` placeholder (``image_placeholder_token``) into the ``<IMG_CONTEXT>`` tokens."""

    def format_prompt(self, prompt: str) -> str:
        token = str(getattr(self.processor, "image_placeholder_token", None) or "<image>")
        return prompt if token in prompt else f"{token}{prompt}"


_ADAPTERS = {"InternVLForConditionalGeneration": InternVLAdapter, "AyaVisionForConditionalGeneration": AyaVisionAdapter,
             "Cohere2VisionForConditionalGeneration": Cohere2VisionAdapter,
             "QianfanOCRForConditionalGeneration": QianfanOCRAdapter}


@register_adapter(priority=20, family=VLM)
def _detect_internvl(model: nn.Module) -> Optional[Adapter]:
    found = _ADAPTERS.get(type(model).__name__)
    if found is None:
        return None
    adapter = found(model)
    if found in (InternVLAdapter, QianfanOCRAdapter):
        adapter.capabilities = adapter.capabilities | {"lrp"}  # (checked against a hand-written oracle)
        adapter.notes.pop("lrp", None)
    else:
        adapter.notes["lrp"] = (f"{type(model).__name__}'s Cohere language model normalises with a LayerNorm written out in "
                                "Python (pow and rsqrt of an activation), which the AttnLRP rules do not cover; use "
                                "cross_generic or cross_grad")
    return adapter
