"""mllama (Llama 3.2 Vision): the image enters the language model through cross-attention layers.

The image processor picks a canvas of ``rows x cols`` tiles (at most ``max_image_tiles``, each
``size`` px square), resizes the image to fit the canvas keeping its aspect ratio, pads it at the
bottom and right with zeros and cuts the canvas into tiles, row-major. The vision tower turns each
tile into a class token followed by its ``g x g`` patch tokens (``g = image_size / patch_size``);
``cross_attention_states`` hold, per image, ``max_image_tiles`` such blocks (the tiles past the
image's own are padding, masked by ``cross_attention_mask``). They are the keys of the language
model's cross-attention layers (``config.text_config.cross_attention_layers``); its sequence holds
one ``<|image|>`` token and no vision token.

So the image's tokens are the keys of its real tiles, in order; the class tokens carry no pixels of
their own (skipped), and each tile's patch grid covers the tile's box of the original image (the
canvas box mapped back through the resize: a tile may reach past the image where the canvas is
padding). The methods read the cross-attention calls (:attr:`MllamaAdapter.cross_layers`).

Text before ``<|image|>`` (a chat template's header) sees no tile in ``cross_attention_mask``;
transformers then unmasks the whole row, so those positions read every key, padding tiles included,
and pass it on through self-attention: ``cross_generic`` follows that as the model runs it (the rows
that predict answer words read only their image's real tiles).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .pixel_tokens import piece_tokens
from .views import ImageView, Piece

__all__ = ["MllamaAdapter", "tiled_view"]


def tiled_view(height: int, width: int, tile: int, patch: int, max_tiles: int) -> ImageView:
    """The token geometry of one (H, W) image (see the module docstring).

    Args:
        height, width: the original image's size.
        tile: the processor's tile size (px, square), the vision tower's ``image_size``.
        patch: the vision tower's patch size.
        max_tiles: the processor's ``max_image_tiles``.

    Returns:
        One :class:`Piece` per real tile (``"tile r,c"``), the class tokens in ``skip``.
    """
    from transformers.models.mllama.image_processing_pil_mllama import (  # (the PIL module: no torchvision needed)
        get_image_size_fit_to_canvas, get_optimal_tiled_canvas)

    canvas_h, canvas_w = (int(v) for v in get_optimal_tiled_canvas(height, width, max_tiles, tile))
    new_h, new_w = (int(v) for v in get_image_size_fit_to_canvas(height, width, canvas_h, canvas_w, tile))
    rows, cols = canvas_h // tile, canvas_w // tile
    grid = tile // patch
    sy, sx = height / new_h, width / new_w
    pieces = []
    for r in range(rows):
        for c in range(cols):
            k = r * cols + c
            box = (r * tile * sy, c * tile * sx, (r + 1) * tile * sy, (c + 1) * tile * sx)
            pieces.append(Piece(f"tile {r},{c}", (grid, grid), box, k * grid * grid))
    skip = tuple(k * (grid * grid + 1) for k in range(rows * cols))
    return ImageView((height, width), tuple(pieces), skip)


class MllamaAdapter(VLMAdapter):
    """``MllamaForConditionalGeneration``: per-word maps from its cross-attention layers."""

    image_token = "<|image|>"
    nested_images = True
    #: the methods read the cross-attention layers; image columns index their keys
    cross_layers = True

    @property
    def tokens_per_tile(self) -> int:
        """A tile's vision tokens: its class token and its patches."""
        vision = self.model.config.vision_config
        return (vision.image_size // vision.patch_size) ** 2 + 1

    def _max_tiles(self) -> int:
        processor = self.image_processor
        vision = self.model.config.vision_config
        size = dict(getattr(processor, "size", None) or {})
        if size.get("height") != vision.image_size or size.get("width") != vision.image_size:
            raise UnsupportedModelError(
                f"the image processor's tiles ({size}) differ from the vision tower's {vision.image_size} px input; "
                "pass the model's own processor"
            )
        return int(processor.max_image_tiles)

    def image_columns(self, inputs: Any) -> list[Tensor]:
        """Per image, the cross-attention keys of its real tiles (class tokens included), in order.

        Raises:
            UnsupportedModelError: a prompt holds more than one image, or its last position does not
                see its image.
        """
        tiles = inputs["aspect_ratio_mask"]  # (B, images, max_tiles)
        if tiles.shape[1] != 1:
            raise UnsupportedModelError(f"mllama explains one image per prompt, got {tiles.shape[1]} per prompt")
        seen = inputs["cross_attention_mask"][:, -1, 0]  # (B, max_tiles): what the last prompt position reads
        per_tile = self.tokens_per_tile
        columns = []
        for b, row in enumerate(tiles[:, 0]):
            count = int(row.sum())
            if int(seen[b].sum()) != count:
                raise UnsupportedModelError(
                    f"prompt {b}'s last position reads {int(seen[b].sum())} of its image's {count} tiles; put the "
                    "<|image|> token before the text"
                )
            columns.append(torch.arange(count * per_tile, device=tiles.device))
        return columns

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        vision = self.model.config.vision_config
        max_tiles = self._max_tiles()
        return [tiled_view(int(image.shape[0]), int(image.shape[1]), vision.image_size, vision.patch_size, max_tiles)
                for image in images]

    def lrp_pixels(self, kwargs: Any) -> str:
        """The processor's tiles (``pixel_values``, (B, 1, max_tiles, C, H, W); the tiles past an image's own are
        padding)."""
        if "pixel_values" not in kwargs or kwargs["pixel_values"].dim() != 6:
            raise UnsupportedModelError(f"the teacher-forced forward of {type(self.model).__name__} holds no (B, 1, tiles, "
                                        "C, H, W) pixel_values; use the model's own processor")
        return "pixel_values"

    def lrp_tokens(self, relevance: Tensor, counts: Sequence[int], inputs: Any = None) -> list[Tensor]:
        """Per image, (T, n_b) relevance of its patch tokens from (B, T, 1, max_tiles, H, W) relevance at its tiles'
        pixels: each patch of its real tiles summed, tiles in order, row-major patches (the class tokens have no pixels
        and are not among them).

        Raises:
            UnsupportedModelError: an image's tokens are not whole tiles of the pixels.
        """
        vision = self.model.config.vision_config
        side = vision.image_size // vision.patch_size
        what = type(self.model).__name__
        return [piece_tokens(relevance[b, :, 0], n, (side, side), what, b, "tile") for b, n in enumerate(counts)]

    def teacher_inputs(self, inputs: Any, ids: Tensor) -> dict[str, Any]:
        """The base teacher-forced inputs, the cross-attention mask extended as ``generate`` extends
        it (each answer position reads what the last prompt position reads)."""
        kwargs = super().teacher_inputs(inputs, ids)
        mask = inputs["cross_attention_mask"]
        kwargs["cross_attention_mask"] = torch.cat([mask, mask[:, -1:].expand(-1, ids.shape[1], -1, -1)], dim=1)
        return kwargs

    def lm_records(self, records: Sequence[Any]) -> list[Any]:
        """The language model's cross-attention records (one per cross-attention layer of one forward)."""
        prefix = self.lm_prefix + "."
        return [r for r in records if r.kind == "cross" and r.name.startswith(prefix)]

    def decoder_records(self, records: Sequence[Any]) -> list[Any]:
        """The language model's self- and cross-attention records, in call order."""
        prefix = self.lm_prefix + "."
        return [r for r in records if r.name.startswith(prefix)]


@register_adapter(priority=20, family=VLM)
def _detect_mllama(model: nn.Module) -> Optional[Adapter]:
    if type(model).__name__ != "MllamaForConditionalGeneration":
        return None
    adapter = MllamaAdapter(model)
    adapter.capabilities = adapter.capabilities | {"lrp"}  # (checked against a hand-written oracle)
    adapter.notes.pop("lrp", None)
    return adapter
