"""PaliGemma and Gemma 3: a SigLIP tower over the whole resized image, a prefix-LM mask.

PaliGemma: one image token per SigLIP patch (``image_seq_length`` of them). Gemma 3: the patch
grid average-pooled to ``mm_tokens_per_image`` tokens (a square grid). Both resize the whole image
(no crop), so the token grid covers the whole original image, and both mark the prompt (image
included) with ``token_type_ids`` 0 and answer tokens with 1 (the prefix attends both ways, the
answer causally); Gemma 3 marks its image tokens with 1 (they attend to each other both ways) and
text with 0. The teacher-forced answer tokens get what ``generate`` gives its generated tokens. Gemma 3's sliding-window layers keep their own mask in the one
teacher-forced call (nothing is stitched across generation steps). PaliGemma counts positions
from 1.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import ImageView, Piece, VLMAdapter, processed_box

__all__ = ["PrefixLMAdapter"]


class PrefixLMAdapter(VLMAdapter):
    """``PaliGemmaForConditionalGeneration`` (``kind="paligemma"``) and ``Gemma3ForConditionalGeneration`` (``"gemma3"``)."""

    def __init__(self, model: nn.Module, kind: str, processor: Any = None) -> None:
        super().__init__(model, processor)
        self.kind = kind
        self.position_offset = 1 if kind == "paligemma" else 0
        self.nested_images = kind == "gemma3"

    def format_prompt(self, prompt: str) -> str:
        if self.kind == "paligemma":
            return super().format_prompt(prompt)  # the processor puts <bos> after the image tokens
        token = getattr(self.processor, "boi_token", None) or "<start_of_image>"
        return prompt if token in prompt else f"{token}{prompt}"

    def grid(self) -> tuple[int, int]:
        config = self.model.config
        if self.kind == "gemma3":
            side = math.isqrt(int(config.mm_tokens_per_image))
            return side, side
        vision = config.vision_config
        size = vision.image_size
        return size // vision.patch_size, size // vision.patch_size

    def prepare(self, images: Sequence[Any], prompts: Sequence[str]) -> Any:
        batch = super().prepare(images, prompts)
        if "token_type_ids" not in batch:
            raise UnsupportedModelError(
                f"the processor gave no token_type_ids, which {type(self.model).__name__} needs for its prefix "
                "mask (PaliGemma: image and prompt attend both ways; Gemma 3: the image tokens do); pass the model's own processor"
            )
        return batch

    def teacher_inputs(self, inputs: Any, ids: Tensor) -> dict[str, Any]:
        kwargs = super().teacher_inputs(inputs, ids)
        types = inputs["token_type_ids"]
        answer = 1 if self.kind == "paligemma" else 0  # PaliGemma: 1 = the causal suffix; Gemma 3: 1 = image tokens
        kwargs["token_type_ids"] = torch.cat([types, torch.full_like(ids, answer, dtype=types.dtype)], dim=1)
        return kwargs

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        grid = self.grid()
        views = []
        for image in images:
            h, w = int(image.shape[0]), int(image.shape[1])
            if getattr(self.processor.image_processor, "do_pan_and_scan", False):
                raise UnsupportedModelError("Gemma 3 with do_pan_and_scan=True (crops) is not supported; use the processor's default")
            views.append(ImageView((h, w), (Piece("image", grid, processed_box(self.processor.image_processor, h, w), 0),)))
        return views


@register_adapter(priority=20, family=VLM)
def _detect_prefix_lm(model: nn.Module) -> Optional[Adapter]:
    name = type(model).__name__
    if name == "PaliGemmaForConditionalGeneration":
        return PrefixLMAdapter(model, "paligemma")
    if name == "Gemma3ForConditionalGeneration":
        return PrefixLMAdapter(model, "gemma3")
    return None
