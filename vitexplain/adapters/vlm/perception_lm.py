"""PerceptionLM (``PerceptionLMForConditionalGeneration``): a thumbnail plus tiles, patch tokens average-pooled.

With ``vision_input_type="thumb+tile"`` (the default) the image processor gives, per image, the whole image resized
to one ``tile_size`` square (the thumbnail, its aspect ratio bent), then the whole image resized to a canvas of
``cols x rows`` tiles (the processor's canvas search: the canvas the image fits without downscaling with the
largest short side, else the closest aspect ratio of at most ``max_num_tiles`` tiles) cut row-major; otherwise the
thumbnail alone. The vision tower (a timm Perception Encoder) cuts each piece into patches, its class token is
dropped (``vision_use_cls_token``), and the projector average-pools ``projector_pooling_ratio``-square blocks of
patches, so each piece is a grid of ``tile / patch / ratio`` tokens a side, row-major; the language model sees the
pieces in that order. The model runs every image's pieces as one (B, pieces, 3, T, T) tensor, so a batch holds
images cut into the same number of pieces.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ...errors import InputError, UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .views import ImageView, Piece

__all__ = ["PerceptionLMAdapter"]


class PerceptionLMAdapter(VLMAdapter):
    """``PerceptionLMForConditionalGeneration`` (see the module docstring)."""

    image_token = "<|image|>"

    def _tiles(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of the processor's canvas for an (H, W) image; (0, 0): the thumbnail alone."""
        processor = self.image_processor
        if getattr(processor, "vision_input_type", "thumb+tile") != "thumb+tile":
            return 0, 0
        tile = int(processor.tile_size)
        if int(processor.max_num_tiles) <= 1:
            return 1, 1
        cols_rows = processor._fit_image_to_canvas(img_width=width, img_height=height, tile_size=tile)
        if cols_rows is None:
            cols_rows = processor._find_closest_aspect_ratio(img_width=width, img_height=height, tile_size=tile)
        return int(cols_rows[1]), int(cols_rows[0])

    def prepare(self, images: Sequence[Any], prompts: Sequence[str]) -> Any:
        pieces = [(rows * cols + 1) for rows, cols in (self._tiles(int(i.shape[0]), int(i.shape[1])) for i in images)]
        if len(set(pieces)) > 1:
            raise InputError(
                f"{type(self.model).__name__} takes a batch's images as one tensor of pieces, and these images are cut into "
                f"{pieces} pieces (a thumbnail plus tiles); explain them in separate calls, or pass "
                "processor_kwargs={'max_num_tiles': 1} (a thumbnail and one tile each)")
        return super().prepare(images, prompts)

    def _grid(self, tile: int) -> tuple[int, int]:
        config = self.model.config
        patch = self.processor.patch_size if getattr(self.processor, "patch_size", None) else None
        ratio = int(config.projector_pooling_ratio)
        if not patch or tile % int(patch) or (tile // int(patch)) % ratio:
            raise UnsupportedModelError(
                f"{tile} px tiles in {patch} px patches pooled {ratio} x {ratio} do not make whole blocks (adaptive pooling "
                "would mix patches of neighbouring tokens); use the model's own PerceptionLMProcessor")
        side = tile // int(patch) // ratio
        return side, side

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        tile = int(inputs["pixel_values"].shape[-1])
        grid = self._grid(tile)
        per_piece = grid[0] * grid[1]
        views = []
        for b, image in enumerate(images):
            h, w = float(image.shape[0]), float(image.shape[1])
            rows, cols = self._tiles(int(h), int(w))
            pieces = [Piece("thumbnail" if rows else "image", grid, (0.0, 0.0, h, w), 0)]
            pieces += [Piece(f"tile {r},{c}", grid, (r * h / rows, c * w / cols, (r + 1) * h / rows, (c + 1) * w / cols),
                             (1 + r * cols + c) * per_piece) for r in range(rows) for c in range(cols)]
            held = int((inputs["input_ids"][b] == self.image_token_id).sum())
            if held != len(pieces) * per_piece or int(inputs["pixel_values"].shape[1]) != len(pieces):
                raise UnsupportedModelError(
                    f"image {b}'s {rows} x {cols} tiles and thumbnail do not give its {held} image tokens; use the model's "
                    "own PerceptionLMProcessor, with the settings it was called with")
            views.append(ImageView((int(h), int(w)), tuple(pieces)))
        return views


@register_adapter(priority=20, family=VLM)
def _detect_perception_lm(model: nn.Module) -> Optional[Adapter]:
    return PerceptionLMAdapter(model) if type(model).__name__ == "PerceptionLMForConditionalGeneration" else None
