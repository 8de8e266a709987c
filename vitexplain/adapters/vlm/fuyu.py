"""Fuyu (``FuyuForCausalLM``): no vision tower, each image patch projected straight into the language model.

The image processor shrinks an image larger than ``size`` to fit it (aspect ratio kept, sides rounded down; a smaller
image keeps its size) and pads it at the bottom and right. The processor cuts the resized image, its last row and
column of patches reaching into the padding, into ``patch_size`` patches, row-major; one linear layer
(``vision_embed_tokens``) turns each patch into the image token at a ``|SPEAKER|`` position, and a ``|NEWLINE|``
token (no pixels, not an image token) ends every row. The processor puts the image tokens in front of every prompt
itself, then ``<s>``, the prompt and the beginning-of-answer token.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from torch import Tensor, nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .views import ImageView, Piece

__all__ = ["FuyuAdapter"]


class FuyuAdapter(VLMAdapter):
    """``FuyuForCausalLM`` (see the module docstring)."""

    image_token = "|SPEAKER|"

    def format_prompt(self, prompt: str) -> str:
        return self.bare_prompt(prompt)  # the processor puts the image tokens in front

    def prepare(self, images: Sequence[Any], prompts: Sequence[str]) -> Any:
        """The processor's batch, its float32 patches in the dtype of the patch projection (``vision_embed_tokens``,
        which reads them with no vision tower to cast them: a half-precision model's)."""
        batch = super().prepare(images, prompts)
        dtype = self.linear_dtype("vision_embed_tokens")
        for key in ("image_patches", "pixel_values"):
            value = batch.get(key)
            if dtype is not None and isinstance(value, Tensor) and value.is_floating_point():
                batch[key] = value.to(dtype)
        return batch

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        processor = self.image_processor
        target = dict(processor.size)
        patch = dict(processor.patch_size)
        ph, pw = int(patch["height"]), int(patch["width"])
        views = []
        for b, image in enumerate(images):
            h, w = int(image.shape[0]), int(image.shape[1])
            rh, rw = h, w
            if getattr(processor, "do_resize", True) and (h > target["height"] or w > target["width"]):
                scale = min(target["height"] / h, target["width"] / w)
                rh, rw = int(h * scale), int(w * scale)
            padded = getattr(processor, "do_pad", True)
            cut_h = min(target["height"] if padded else rh, math.ceil(rh / ph) * ph)
            cut_w = min(target["width"] if padded else rw, math.ceil(rw / pw) * pw)
            grid = (cut_h // ph, cut_w // pw)
            held = int((inputs["input_ids"][b] == self.image_token_id).sum())
            if grid[0] * grid[1] != held:
                raise UnsupportedModelError(
                    f"image {b}'s {rh} x {rw} px resized image in {ph} x {pw} px patches does not give its {held} image "
                    "tokens; use the model's own FuyuProcessor, with the settings it was called with")
            box = (0.0, 0.0, grid[0] * ph * h / rh, grid[1] * pw * w / rw)
            views.append(ImageView((h, w), (Piece("image", grid, box, 0),)))
        return views


@register_adapter(priority=20, family=VLM)
def _detect_fuyu(model: nn.Module) -> Optional[Adapter]:
    return FuyuAdapter(model) if type(model).__name__ == "FuyuForCausalLM" else None
