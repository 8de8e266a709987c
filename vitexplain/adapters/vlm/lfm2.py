"""LFM2-VL (``Lfm2VlForConditionalGeneration``): a SigLIP2 NaFlex tower, pixel unshuffle, tiles plus a thumbnail, and
a hybrid language model.

The processor either smart-resizes the whole image (no crop; sides multiples of ``encoder_patch_size *
downsample_factor``) into one piece, or, when the image is too large, resizes it to a ``rows x cols`` canvas of
``tile_size`` tiles (the whole image, its aspect ratio bent to the canvas'), cut row-major, followed by the
smart-resized whole image as a thumbnail. Each piece's patches (``spatial_shapes`` (h, w) per piece) are unshuffled
``f x f`` (``downsample_factor``) into one token per block, row-major; the language model sees the pieces' tokens in
that order, between ``<|img_row_r_col_c|>`` / ``<|img_thumbnail|>`` separators that carry no pixels. The rows and
columns are the image processor's (``return_row_col_info``), checked against ``spatial_shapes`` and the image tokens.

LFM2's language model mixes tokens in short-convolution layers as well as attention layers: ``cross`` and
``cross_grad`` read the attention layers, ``cross_generic`` is refused.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter, processor_images
from .views import ImageView, Piece

__all__ = ["Lfm2VlAdapter"]


class Lfm2VlAdapter(VLMAdapter):
    """``Lfm2VlForConditionalGeneration`` (see the module docstring)."""

    nested_images = True

    def __init__(self, model: nn.Module, processor: Any = None) -> None:
        super().__init__(model, processor)
        self.without_attention_flow(getattr(model.config.get_text_config(), "layer_types", None) or [],
                                    "short convolutions")

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        processor = self.image_processor
        known = set(getattr(getattr(processor, "valid_kwargs", None), "__annotations__", {}))
        settings = {k: v for k, v in self.processor_kwargs.items() if k in known}
        layout = processor([[image] for image in processor_images(images)], return_row_col_info=True, **settings)
        f = int(self.model.config.downsample_factor)
        shapes = inputs["spatial_shapes"].tolist()
        views, start = [], 0
        for b, image in enumerate(images):
            h, w = int(image.shape[0]), int(image.shape[1])
            rows, cols = int(layout["image_rows"][b]), int(layout["image_cols"][b])
            tiles = rows * cols if rows * cols > 1 else 0
            held = int((inputs["input_ids"][b] == self.image_token_id).sum())
            count = tiles + (1 if tiles == 0 or held > tiles * _tokens(shapes[start], f) else 0)  # (+ the thumbnail)
            pieces, offset = [], 0
            for k, (ph, pw) in enumerate(shapes[start:start + count]):
                grid = (ph // f, pw // f)
                if k < tiles:
                    r, c = divmod(k, cols)
                    box = (r * h / rows, c * w / cols, (r + 1) * h / rows, (c + 1) * w / cols)
                    pieces.append(Piece(f"tile {r},{c}", grid, box, offset))
                else:
                    pieces.append(Piece("thumbnail" if tiles else "image", grid, (0.0, 0.0, float(h), float(w)), offset))
                offset += grid[0] * grid[1]
            if offset != held or len(pieces) != count:
                raise UnsupportedModelError(
                    f"image {b}'s {rows} x {cols} tiles and pieces {shapes[start:start + count]} do not give its {held} "
                    "image tokens; use the model's own Lfm2VlProcessor, with the settings it was called with")
            start += count
            views.append(ImageView((h, w), tuple(pieces)))
        return views


def _tokens(shape: Sequence[int], f: int) -> int:
    """Tokens of one piece of ``shape`` (h, w) patches unshuffled ``f x f``."""
    return (int(shape[0]) // f) * (int(shape[1]) // f)


@register_adapter(priority=20, family=VLM)
def _detect_lfm2_vl(model: nn.Module) -> Optional[Adapter]:
    return Lfm2VlAdapter(model) if type(model).__name__ == "Lfm2VlForConditionalGeneration" else None
