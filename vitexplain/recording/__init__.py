"""``vitexplain.recording``: scoped capture of attention (fused SDPA kept on), activations, CNN gates and their gradients.

The public entry point is :func:`vitexplain.capture` (``vx.capture``, :mod:`vitexplain.facade`):
this package's :class:`Recorder` with the token layout of the model's adapter. Nothing here
recognises a model family (``vitexplain.recording.capture`` is the same recorder without
``rec.layout``, unless given a ``layout_fn``).
"""

from .compiled import unwrap_compiled
from .custom import (
    AttentionWeights,
    ModuleInputs,
    from_attribute,
    from_output,
    register_attention,
    registered_attention,
    unregister_attention,
)
from .gates import GateRecord, GateSpec, register_gate, supported_gates
from .activations import ActivationRecord
from .records import AttentionRecord
from .scores import attention_probs
from .recorder import Recorder, capture, hooks_paused

__all__ = [
    "capture",
    "Recorder",
    "hooks_paused",
    "unwrap_compiled",
    "AttentionRecord",
    "ActivationRecord",
    "GateRecord",
    "GateSpec",
    "register_gate",
    "supported_gates",
    "attention_probs",
    "AttentionWeights",
    "ModuleInputs",
    "register_attention",
    "unregister_attention",
    "registered_attention",
    "from_output",
    "from_attribute",
]

