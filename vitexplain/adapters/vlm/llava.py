"""LLaVA (``LlavaForConditionalGeneration``): one image token per vision-tower patch.

The processor resizes (shortest edge) and centre-crops the image; the vision tower's patch grid
over that crop is the token grid, in row-major order (the class token is dropped by the
``"default"`` feature strategy and kept, without pixels, by ``"full"``; a SigLIP tower has none, so
``"default"`` drops its first patch: the sequence holds patches 1.. and patch (0, 0) scores 0).
With a Pixtral tower (Pixtral-12B) the image keeps its native resolution: one token per patch of the
processor's resized image (``image_sizes``), rows ended by ``[IMG_BREAK]`` (no pixels), as Mistral 3
without its merger (:mod:`~vitexplain.adapters.vlm.mistral3`). Video-LLaVA's images take the same path through its
image tower.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .pixel_tokens import sum_cells
from .views import ImageView, Piece, processed_box
from .mistral3 import native_tokens, native_views

__all__ = ["LlavaAdapter", "VideoLlavaAdapter", "tower_has_class_token"]


class LlavaAdapter(VLMAdapter):
    """LLaVA-1.5-style models (``LlavaForConditionalGeneration``, and ViP-LLaVA, whose projector reads several tower layers
    of the same patch tokens)."""

    #: the processor's keys of the images' pixels (the first present is read), and the model's attribute of the tower
    #: that reads them
    pixel_keys: tuple[str, ...] = ("pixel_values",)
    tower_name = "vision_tower"

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        config = self.model.config
        patch = config.vision_config.patch_size
        if getattr(config.vision_config, "model_type", None) == "pixtral":  # Pixtral-12B: native resolution, no merge
            return native_views(images, inputs, int(patch))
        found = [key for key in self.pixel_keys if key in inputs]
        pixels = inputs[found[0] if found else self.pixel_keys[0]]  # (none: the KeyError of another family's processor)
        gh, gw = pixels.shape[-2] // patch, pixels.shape[-1] // patch
        # "full" keeps the tower's class token (no pixels); a tower without one (SigLIP) keeps none
        strategy = getattr(config, "vision_feature_select_strategy", "default")  # (VipLlava: the class token dropped)
        extra = 1 if strategy == "full" and self._tower_has_class_token() else 0
        if not isinstance(config.vision_feature_layer, int) and len(config.vision_feature_layer) == 0:
            raise UnsupportedModelError("LLaVA config without a vision feature layer")
        # "default" without a class token drops patch (0, 0): the sequence holds the other patches (to_pixel_tokens)
        sequence = gh * gw - 1 if self._drops_first_patch() else None
        views = []
        for image in images:
            h, w = int(image.shape[0]), int(image.shape[1])
            box = processed_box(self.image_processor, h, w)
            views.append(ImageView((h, w), (Piece("image", (gh, gw), box, extra),), sequence_tokens=sequence))
        return views

    def _drops_first_patch(self) -> bool:
        """The "default" strategy (ViP-LLaVA's only one) drops the first vision token, a patch when the tower has no
        class token (SigLIP)."""
        strategy = getattr(self.model.config, "vision_feature_select_strategy", "default")
        return strategy == "default" and not self._tower_has_class_token()

    def to_pixel_tokens(self, scores: list[Tensor], recorder: Any) -> list[Tensor]:
        """Per image, (T, n) scores of its image tokens as scores of its patches: patch (0, 0) scores 0 where the
        "default" strategy dropped it (no token of the sequence carries it)."""
        if not self._drops_first_patch():
            return scores
        return [torch.cat([s.new_zeros(s.shape[0], 1), s], dim=-1) for s in scores]

    def lrp_pixels(self, kwargs: Any) -> str:
        """The processor's pixel key the tower reads (``pixel_values``)."""
        found = [key for key in self.pixel_keys if key in kwargs]
        if not found:
            raise UnsupportedModelError(f"the teacher-forced forward of {type(self.model).__name__} holds none of "
                                        f"{self.pixel_keys}; use the model's own processor")
        return found[0]

    def lrp_tokens(self, relevance: Tensor, counts: Sequence[int], inputs: Any = None) -> list[Tensor]:
        """Per image, (T, n_b) relevance of its image tokens: (B, T, H, W) pixel relevance of the processed crop summed
        over each patch of the tower's grid (row-major, the sequence's order; a Pixtral tower: each image's resized
        pixels, :func:`~vitexplain.adapters.vlm.mistral3.native_tokens`); the class token ("full") has no pixels
        and scores 0; where "default" drops patch (0, 0) (SigLIP) its pixels are left out (no token carries them).

        Raises:
            UnsupportedModelError: an image holds another number of image tokens than the patch grid gives.
        """
        patch = int(self.model.config.vision_config.patch_size)
        if getattr(self.model.config.vision_config, "model_type", None) == "pixtral":  # native resolution, rows of patches
            return native_tokens(relevance, counts, inputs["image_sizes"], patch, type(self.model).__name__)
        t, h, w = relevance.shape[1:]
        gh, gw = h // patch, w // patch
        cells = sum_cells(relevance, (gh, gw), type(self.model).__name__)  # (B, T, gh * gw)
        out = []
        for image, n in enumerate(counts):
            if n == gh * gw:
                out.append(cells[image])
            elif n == gh * gw + 1 and self._tower_has_class_token():  # "full": the class token first, no pixels
                out.append(torch.cat([cells.new_zeros(t, 1), cells[image]], dim=-1))
            elif n == gh * gw - 1 and self._drops_first_patch():
                out.append(cells[image, :, 1:])
            else:
                raise UnsupportedModelError(f"image {image} has {n} image tokens, but the {gh} x {gw} patch grid of "
                                            f"{type(self.model).__name__}'s tower gives {gh * gw}")
        return out

    def _tower_has_class_token(self) -> bool:
        return tower_has_class_token(self.model, self.tower_name)


def tower_has_class_token(model: nn.Module, tower_name: str = "vision_tower") -> bool:
    """Whether the model's vision tower (its attribute ``tower_name``) prepends a class token (CLIP does, SigLIP does not).

    Raises:
        UnsupportedModelError: the model has no such tower.
    """
    tower = getattr(getattr(model, "model", model), tower_name, None)
    tower = tower if tower is not None else getattr(model, tower_name, None)
    if tower is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no {tower_name} to read the image tokens from")
    return any(hasattr(module, "class_embedding") for module in tower.modules())


class VideoLlavaAdapter(LlavaAdapter):
    """Video-LLaVA explaining images: LLaVA-1.5's geometry on its image tower (``image_tower``; the processor gives
    the pixels as ``pixel_values_images``, as ``pixel_values`` from transformers 5.23 on; videos go through a tower of
    their own, not explained here)."""

    pixel_keys = ("pixel_values_images", "pixel_values")
    tower_name = "image_tower"


@register_adapter(priority=20, family=VLM)
def _detect_llava(model: nn.Module) -> Optional[Adapter]:
    name = type(model).__name__
    if name in ("LlavaForConditionalGeneration", "VipLlavaForConditionalGeneration", "VideoLlavaForConditionalGeneration"):
        adapter = VideoLlavaAdapter(model) if name.startswith("Video") else LlavaAdapter(model)
        adapter.capabilities = adapter.capabilities | {"lrp"}  # (checked against a hand-written oracle)
        adapter.notes.pop("lrp", None)
        return adapter
    return None
