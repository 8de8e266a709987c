"""Vision-language models that are recognised but not explained yet, each with the reason.

Their image does not reach the language model as one token per image region in its own sequence
in a way the adapters can map back to the pixels yet; rather than reading attention that would
mean something else, every VLM method is refused with the reason (the plan quotes it).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter

__all__ = ["RefusedVLMAdapter", "REASONS"]

_QFORMER = ("its image reaches the language model as {n} learned query tokens from a {what}, each of which depends on "
            "every pixel; a map must go through that module's cross-attention to the patches, which is not implemented")

#: model class -> why the VLM methods do not apply
REASONS: dict[str, str] = {
    "MllamaForConditionalGeneration": (
        "mllama's image enters through cross-attention layers (cross_attention_states), not as tokens in the language "
        "model's self-attention sequence, so the joint-sequence methods do not apply; its cross-attention per tile "
        "is not mapped to pixels yet"),
    "Blip2ForConditionalGeneration": _QFORMER.format(n="32", what="Q-Former"),
    "InstructBlipForConditionalGeneration": _QFORMER.format(n="32", what="Q-Former"),
    "Kosmos2ForConditionalGeneration": _QFORMER.format(n="64", what="latent-query resampler (image_to_text_projection)"),
    "Florence2ForConditionalGeneration": (
        "Florence-2 is an encoder-decoder (DaViT + BART): its decoder reads the image through cross-attention to an "
        "encoder sequence that mixes the image tokens with the prompt, which is not mapped to pixels yet"),
    "Pix2StructForConditionalGeneration": (
        "Pix2Struct is an encoder-decoder over variable-resolution patches: its decoder's cross-attention to the "
        "flattened patches is not mapped back to the image yet"),
}


class RefusedVLMAdapter(VLMAdapter):
    """A recognised VLM that no method applies to; ``notes["joint"]`` says why."""

    def __init__(self, model: nn.Module, processor: Any = None) -> None:
        super().__init__(model, processor)
        self.capabilities = frozenset()
        self.notes["joint"] = REASONS[type(model).__name__]


@register_adapter(priority=20, family=VLM)
def _detect_refused(model: nn.Module) -> Optional[Adapter]:
    return RefusedVLMAdapter(model) if type(model).__name__ in REASONS else None
