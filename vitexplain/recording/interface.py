"""Hugging Face's attention interface as a place to intercept: only the attention call itself is watched.

Hugging Face attention modules fetch their attention function at every call with
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)``
(``transformers.modeling_utils.AttentionInterface``) and call it as
``attention_interface(self, query, key, value, attention_mask, ...)``. While at least one capture
is open, the ``"sdpa"`` and ``"flex_attention"`` entries of that registry's global mapping are
*taps*: functions that call the original one, unchanged, with the same arguments. A tap knows the
issuing module (its first argument); when that module belongs to a capture open in the calling
thread, the capture's torch function mode is active for the duration of the original function
only (:meth:`TapOwner.through_interface`), so the few torch calls it makes (reshapes, the SDPA
or FlexAttention call) are intercepted and nothing else of the model is. For every other module
and every other thread the tap calls the original function at once.

The registry is touched only while a capture is open (reference counted over captures and
threads, under a lock) and only for entries that still hold transformers' own functions; on the
last exit each entry that still holds the tap gets its original back, so the mapping is then
exactly as found. Nothing is imported: without ``transformers`` in ``sys.modules`` no model can
use the interface, and nothing is installed.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Optional, Protocol

from torch import nn

from .flex import refuse_cpu_backward

__all__ = ["TapOwner", "open_taps", "close_taps", "KEYS", "TAP_CODE"]

#: The registry entries tapped, with the module and name of transformers' own function for each.
KEYS = {
    "sdpa": ("transformers.integrations.sdpa_attention", "sdpa_attention_forward"),
    "flex_attention": ("transformers.integrations.flex_attention", "flex_attention_forward"),
}

_REGISTRY_MODULE = "transformers.modeling_utils"


class TapOwner(Protocol):
    """A capture as the taps see it (the recorder's narrowing, :mod:`vitexplain.recording.narrowing`)."""

    def owns(self, module: nn.Module) -> bool:
        """Whether ``module`` is a module of the captured model."""

    def through_interface(self, original: Callable, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Call ``original(module, *args, **kwargs)`` with the capture's mode active; return its result."""


_lock = threading.Lock()
_open = 0
_installed: dict[str, tuple[Callable, Callable]] = {}  # key -> (original, tap)
_local = threading.local()  # .owners: the TapOwners open in this thread, innermost last


def _owners() -> list:
    owners = getattr(_local, "owners", None)
    if owners is None:
        owners = _local.owners = []
    return owners


def _flex_check(args: tuple) -> None:
    """transformers' ``flex_attention_forward(module, query, key, value, ...)`` in a capture: the watcher's CPU-backward
    refusal (:func:`~vitexplain.recording.flex.refuse_cpu_backward`), which the watcher itself cannot apply there
    (the function calls a ``torch.compile``-d ``flex_attention``, whose dynamo-transformed frames it does not know)."""
    if len(args) >= 3:
        refuse_cpu_backward(*args[:3])


def _make_tap(original: Callable, check: Optional[Callable[[tuple], None]] = None) -> Callable:
    def tap(module: Any, *args: Any, **kwargs: Any) -> Any:
        owners = getattr(_local, "owners", None)
        if owners:
            if len(owners) == 1:  # the usual case: one capture open in this thread
                if owners[0].owns(module):
                    if check is not None:
                        check(args)
                    return owners[0].through_interface(original, module, args, kwargs)
            else:
                mine = [o for o in owners if o.owns(module)]
                if mine:
                    if check is not None:
                        check(args)
                    return _through(mine, original, module, args, kwargs)
        return original(module, *args, **kwargs)

    tap.__wrapped__ = original  # type: ignore[attr-defined]
    tap.__name__ = getattr(original, "__name__", "attention")
    tap.__doc__ = original.__doc__
    return tap


#: The code of every tap (one ``def``): a frame of it is a tap's, called by the issuing module's method.
TAP_CODE = _make_tap(lambda *args, **kwargs: None).__code__


def _through(owners: list, original: Callable, module: Any, args: tuple, kwargs: dict) -> Any:
    """Each owner's mode around the next (outermost capture first), the original call innermost."""
    if len(owners) == 1:
        return owners[0].through_interface(original, module, args, kwargs)

    def inner(m: Any, *a: Any, **kw: Any) -> Any:
        return _through(owners[1:], original, m, a, kw)

    return owners[0].through_interface(inner, module, args, kwargs)


def _registry() -> Optional[dict]:
    """``AttentionInterface._global_mapping``, or None when transformers is not imported."""
    module = sys.modules.get(_REGISTRY_MODULE)
    interface = getattr(module, "AttentionInterface", None)
    mapping = getattr(interface, "_global_mapping", None)
    return mapping if isinstance(mapping, dict) else None


def open_taps(owner: TapOwner) -> None:
    """Make ``owner`` seen by the taps in this thread (installing them on the first open capture)."""
    global _open
    with _lock:
        if _open == 0:
            mapping = _registry()
            if mapping is not None:
                for key, (module_name, name) in KEYS.items():
                    original = getattr(sys.modules.get(module_name), name, None)
                    if original is not None and mapping.get(key) is original:
                        tap = _make_tap(original, _flex_check if key == "flex_attention" else None)
                        mapping[key] = tap
                        _installed[key] = (original, tap)
        _open += 1
    _owners().append(owner)


def close_taps(owner: TapOwner) -> None:
    """Undo :func:`open_taps` (the last open capture puts the original functions back)."""
    global _open
    owners = _owners()
    for i in range(len(owners) - 1, -1, -1):
        if owners[i] is owner:
            del owners[i]
            break
    with _lock:
        _open -= 1
        if _open == 0:
            mapping = _registry()
            for key, (original, tap) in _installed.items():
                if mapping is not None and mapping.get(key) is tap:
                    mapping[key] = original
            _installed.clear()


def tapped() -> dict[str, Callable]:
    """The entries tapped now (key -> original function), for tests."""
    with _lock:
        return {key: original for key, (original, _) in _installed.items()}
