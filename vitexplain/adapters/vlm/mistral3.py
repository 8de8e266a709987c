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

from torch import Tensor, nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .pixel_tokens import sum_cells
from .views import ImageView, Piece

__all__ = ["Mistral3Adapter", "LightOnOcrAdapter", "native_views", "native_tokens"]


class Mistral3Adapter(VLMAdapter):
    """``Mistral3ForConditionalGeneration`` (see the module docstring)."""

    image_token = "[IMG]"

    def _block(self) -> int:
        """Pixels per side of one token's cell: a patch merged ``spatial_merge_size`` x ``spatial_merge_size``."""
        config = self.model.config
        return int(config.vision_config.patch_size) * int(config.spatial_merge_size)

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        return native_views(images, inputs, self._block())

    def lrp_pixels(self, kwargs: Any) -> str:
        """The processor's resized images (``pixel_values``, (B, C, H, W), padded to the batch's largest)."""
        if "pixel_values" not in kwargs or kwargs["pixel_values"].dim() != 4 or "image_sizes" not in kwargs:
            raise UnsupportedModelError(f"the teacher-forced forward of {type(self.model).__name__} holds no (B, C, H, W) "
                                        "pixel_values with image_sizes; use the model's own processor")
        return "pixel_values"

    def lrp_tokens(self, relevance: Tensor, counts: Sequence[int], inputs: Any = None) -> list[Tensor]:
        """Per image, (T, n_b) relevance of its tokens: :func:`native_tokens` with a merged block per token."""
        return native_tokens(relevance, counts, inputs["image_sizes"], self._block(), type(self.model).__name__)


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


def native_tokens(relevance: Tensor, counts: Sequence[int], sizes: Tensor, block: int, what: str) -> list[Tensor]:
    """Per image, (T, n_b) relevance of its tokens from (B, T, H, W) relevance at the batch's padded pixels: image b's
    resized ``sizes[b]`` pixels (the padding, which the tower does not read, left out) summed over each ``block`` x
    ``block`` cell, row-major (Pixtral's patches, merged by Mistral 3's patch merger; the row breaks have no pixels).

    Raises:
        UnsupportedModelError: an image holds another number of tokens than its cells.
    """
    out = []
    for b, ((rh, rw), n) in enumerate(zip(sizes.tolist(), counts)):
        grid = (int(rh) // block, int(rw) // block)
        if grid[0] * grid[1] != n:
            raise UnsupportedModelError(f"image {b} has {n} image tokens, but its {rh}x{rw} resized pixels in {block} px "
                                        f"cells give {grid[0] * grid[1]}; use the model's own processor")
        out.append(sum_cells(relevance[b: b + 1, :, : int(rh), : int(rw)], grid, what)[0])
    return out


class LightOnOcrAdapter(Mistral3Adapter):
    """``LightOnOcrForConditionalGeneration``: Mistral 3's tower and merger (its geometry), no row-break tokens, the image
    token ``<|image_pad|>``."""

    image_token = "<|image_pad|>"


@register_adapter(priority=20, family=VLM)
def _detect_mistral3(model: nn.Module) -> Optional[Adapter]:
    if type(model).__name__ == "LightOnOcrForConditionalGeneration":
        adapter: Mistral3Adapter = LightOnOcrAdapter(model)
    elif type(model).__name__ == "Mistral3ForConditionalGeneration":
        adapter = Mistral3Adapter(model)
    else:
        return None
    adapter.capabilities = adapter.capabilities | {"lrp"}  # (checked against a hand-written oracle)
    adapter.notes.pop("lrp", None)
    return adapter
