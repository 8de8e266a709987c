"""Scoped capture of attention (fused SDPA kept on), activations, CNN gates and their gradients."""

import sys as _sys
import types as _types
from typing import Any as _Any

from .gates import GateRecord, GateSpec, register_gate, supported_gates
from .records import ActivationRecord, AttentionRecord, attention_probs
from .recorder import Recorder, capture

__all__ = [
    "capture",
    "Recorder",
    "AttentionRecord",
    "ActivationRecord",
    "GateRecord",
    "GateSpec",
    "register_gate",
    "supported_gates",
    "attention_probs",
]


class _CallableModule(_types.ModuleType):
    """``vx.capture`` is both this package and the function: Python binds the package as the
    attribute ``vitexplain.capture`` when it is imported first (e.g. by ``vx.Explainer``), so the
    package forwards calls to :func:`capture` and ``vx.capture(model)`` works either way."""

    def __call__(self, *args: _Any, **kwargs: _Any) -> Recorder:
        return capture(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
