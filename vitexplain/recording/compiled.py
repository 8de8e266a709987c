"""``torch.compile``-d models inside a capture: recorded as the original module, run eagerly.

A compiled model (an ``OptimizedModule``) is unwrapped (``_orig_mod``) and recorded as the
original module; inside the scope the compiler's stance is ``"force_eager"``, so calling the
compiled model runs the original module eagerly (every attention call is seen, the maps equal
the uncompiled model's) and nothing is compiled or recompiled. The compiled code is reused
unchanged after the scope. The stance is process-wide: captures open at once share it (:func:`eager_stance`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["unwrap_compiled", "eager_stance"]


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The original module of a ``torch.compile``-d model (itself otherwise)."""
    while isinstance(model, nn.Module):
        # an OptimizedModule holds its original as a submodule (read without nn.Module.__getattr__'s miss, an
        # exception per capture for every other model)
        inner = model._modules.get("_orig_mod")
        inner = model.__dict__.get("_orig_mod") if inner is None else inner
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


_lock = threading.Lock()
_holders = [0]  # captures that hold the stance now (in any thread)
_entered: list[Any] = [None]  # the stance the first of them entered (its __exit__ restores the one found)


def eager_stance(compiled: bool) -> Optional[Callable[[], None]]:
    """Hold the ``"force_eager"`` compiler stance when the model or one of its submodules is compiled.

    The stance is one setting for the whole process: captures open at the same time (in several threads)
    share one ``"force_eager"``, counted under a lock; the last one to leave restores the stance the first one
    found. (Each capture entering and leaving the stance itself let the first one to close switch compiling back
    on under a capture still open in another thread, and the last one restore the ``"force_eager"`` it had found:
    torch.compile off for good.)

    Args:
        compiled: the captured model was a compiled one (unwrapped by :func:`unwrap_compiled`), or one
            of its submodules is (``discovery.Survey.compiled``).

    Returns:
        A function that releases this capture's hold (call it once), or None when nothing is compiled.
    """
    if not compiled:
        return None
    with _lock:
        if _holders[0] == 0:
            _entered[0] = torch.compiler.set_stance("force_eager")  # in force now; its __exit__ restores the prior
        _holders[0] += 1
    return _release


def _release() -> None:
    with _lock:
        _holders[0] -= 1
        if _holders[0] == 0 and _entered[0] is not None:
            stance, _entered[0] = _entered[0], None
            stance.__exit__(None, None, None)
