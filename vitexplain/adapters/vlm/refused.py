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

#: model class -> why the VLM methods do not apply
REASONS: dict[str, str] = {
}


class RefusedVLMAdapter(VLMAdapter):
    """A recognised VLM that no method applies to; ``notes["image_attention"]`` says why."""

    def __init__(self, model: nn.Module, processor: Any = None) -> None:
        super().__init__(model, processor)
        self.capabilities = frozenset()
        self.notes["joint"] = self.notes["image_attention"] = REASONS[type(model).__name__]


@register_adapter(priority=20, family=VLM)
def _detect_refused(model: nn.Module) -> Optional[Adapter]:
    return RefusedVLMAdapter(model) if type(model).__name__ in REASONS else None
