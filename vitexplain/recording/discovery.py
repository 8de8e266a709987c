"""What a capture learned about where a model issues attention, kept for its next capture.

A capture first *discovers* a model with its mode on every torch call (``narrowing.py``): which
code ran, and which module classes issued attention outside Hugging Face's attention interface.
Explaining a model means opening one capture per call (``Explainer.explain`` on each batch), so
that discovery would be paid on every batch. What it learned is kept here, per model (weakly: a
model that is garbage collected takes its entry with it), and a later capture of the same model
starts narrowed from its first torch call.

The entry is used only while the model is as it was: the same modules under the same names
(identity and class), the same forward for each (an instance's own ``forward``, its class's),
the same Hugging Face attention implementation (``config._attn_implementation`` of each module's
config: ``"eager"`` issues attention outside the interface) and the same train/eval mode.
Anything else makes the capture discover again. A capture that narrowed still learns: code that
ran for the first time under its tripwires, and classes that issued attention there, are added.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Mapping, Optional

from torch import nn

__all__ = ["Learned", "fingerprint", "recall", "remember", "forget"]


@dataclass
class Learned:
    """What the captures of one model learned.

    Attributes:
        key: the model's :func:`fingerprint` when it was learned.
        codes: the code objects that ran with the mode on, by id (held, so ids are not reused).
        issuer_types: classes whose modules issued attention outside the interface.
        prepared: what narrowing decided from them, kept until they change: the classes whose
            forward names an attention function, and the names of the modules that get a tripwire.
    """

    key: tuple
    codes: dict[int, CodeType] = field(default_factory=dict)
    issuer_types: frozenset[type] = frozenset()
    prepared: Optional[tuple[frozenset[type], tuple[str, ...]]] = None


_MEMO: "weakref.WeakKeyDictionary[nn.Module, Learned]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _implementation(config: Any) -> Any:
    """A Hugging Face config's attention implementation (None for anything else)."""
    try:
        return getattr(config, "_attn_implementation", None)
    except Exception:  # a config-like object whose attribute access fails: nothing to compare
        return None


def fingerprint(model: nn.Module, modules: Mapping[str, nn.Module]) -> tuple:
    """What must not change for a learned entry to hold (see the module docstring).

    Args:
        model: the captured model.
        modules: its ``named_modules()``.
    """
    entries = []
    configs: dict[int, Any] = {}
    for name, module in modules.items():
        own = module.__dict__
        entries.append((name, id(module), type(module), type(module).forward, own.get("forward")))
        config = own.get("config")
        if config is not None and id(config) not in configs:
            configs[id(config)] = _implementation(config)
    return tuple(entries), tuple(configs.items()), model.training


def recall(model: nn.Module, key: tuple) -> Optional[Learned]:
    """The entry learned for ``model`` if its fingerprint is still ``key``, else None."""
    learned = _MEMO.get(model)
    return learned if learned is not None and learned.key == key else None


def remember(model: nn.Module, key: tuple, codes: Mapping[int, CodeType], issuer_types: set[type]) -> None:
    """Add what a capture of ``model`` (fingerprint ``key``) learned; an entry for another key is replaced."""
    with _lock:
        learned = _MEMO.get(model)
        if learned is None or learned.key != key:
            learned = _MEMO[model] = Learned(key)
        learned.codes = {**learned.codes, **codes}
        learned.issuer_types = learned.issuer_types | frozenset(issuer_types)
        learned.prepared = None


def forget(model: nn.Module) -> None:
    """Drop what was learned about ``model`` (its next capture discovers it again)."""
    with _lock:
        _MEMO.pop(model, None)
