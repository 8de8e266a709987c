"""Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral Small 3.1 / Pixtral-style): native-resolution
images, a 2 x 2 patch merger, ``[IMG_BREAK]`` after each row.

The processor resizes the whole image (no crop) so that its longest edge is at most ``longest_edge``,
to multiples of the patch size, and gives ``image_sizes`` (the resized height and width; a batch's
``pixel_values`` are padded to its largest image). The Pixtral tower's patches are merged
``spatial_merge_size`` x ``spatial_merge_size`` by the projector's patch merger, so the language
model sees one ``[IMG]`` token per merged block, row by row; an ``[IMG_BREAK]`` token ends every row
but the last, which ends with ``[IMG_END]``. Those two carry no pixels and are not image tokens
(only ``image_token_index`` positions are), so each image is one grid over the whole image. LightOnOCR has the same
tower, merger and geometry, without the row-break tokens.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .views import ImageView, Piece

__all__ = ["Mistral3Adapter", "LightOnOcrAdapter", "native_views"]


class Mistral3Adapter(VLMAdapter):
    """``Mistral3ForConditionalGeneration`` (see the module docstring)."""

    image_token = "[IMG]"

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        config = self.model.config
        return native_views(images, inputs, int(config.vision_config.patch_size) * int(config.spatial_merge_size))


def native_views(images: Sequence[Any], inputs: Any, block: int) -> list[ImageView]:
    """One grid per image of the processor's ``image_sizes`` (the resized image, no crop) in ``block`` x ``block``
    pixel cells, over the whole original image (Pixtral's native resolution; Mistral 3 merges patches)."""
    sizes = inputs.get("image_sizes")
    if sizes is None or len(sizes) != len(images):
        raise UnsupportedModelError(f"the processor gave no image_sizes for each of the {len(images)} images; "
                                    "use the model's own (Pixtral) processor")
    views = []
    for image, (rh, rw) in zip(images, sizes.tolist()):
        h, w = int(image.shape[0]), int(image.shape[1])
        grid = (int(rh) // block, int(rw) // block)
        # the grid covers the resized image's first grid * block pixels: the whole image when they divide
        box = (0.0, 0.0, grid[0] * block * h / rh, grid[1] * block * w / rw)
        views.append(ImageView((h, w), (Piece("image", grid, box, 0),)))
    return views


class LightOnOcrAdapter(Mistral3Adapter):
    """``LightOnOcrForConditionalGeneration``: Mistral 3's tower and merger (its geometry), no row-break tokens, the image
    token ``<|image_pad|>``."""

    image_token = "<|image_pad|>"


@register_adapter(priority=20, family=VLM)
def _detect_mistral3(model: nn.Module) -> Optional[Adapter]:
    if type(model).__name__ == "LightOnOcrForConditionalGeneration":
        return LightOnOcrAdapter(model)
    return Mistral3Adapter(model) if type(model).__name__ == "Mistral3ForConditionalGeneration" else None
