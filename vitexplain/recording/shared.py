"""Process-wide state that captures open at the same time in several threads share.

Hook registration: ``torch.utils.hooks.RemovableHandle`` numbers handles with a class counter that it reads and
then increments, so two threads registering hooks at the same moment can get the same id; on one module (the same
model captured in two threads) the second hook then replaces the first in the module's hook dict, and removing one
removes the other. Every hook the capture registers is registered holding :data:`HOOKS`, so no two of them share
an id.

``nn.MultiheadAttention``'s C++ fast path (``torch.backends.mha``) computes MHA in one C++ call that no torch
function mode sees, so a capture switches it off for its scope. The switch is one flag for the whole process:
captures open at the same time in several threads share one switch-off, counted under a lock. The first capture
saves the flag and clears it; the last one to close puts the saved value back. (Each capture saving and restoring
the flag itself let a capture that closed first switch the fast path back on under one still open in another thread,
whose MHA calls then went unrecorded, and let the last one restore the "off" it had found, leaving the fast path off
for good.)
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

__all__ = ["HOOKS", "hold_fastpath_off", "release_fastpath"]

#: held while the capture registers hooks (see the module docstring); re-entrant
HOOKS = threading.RLock()

_lock = threading.Lock()
_holders = [0]
_saved: list[Optional[bool]] = [None]  # the flag as the first open capture found it


def _switch() -> Optional[object]:
    mha = getattr(torch.backends, "mha", None)
    return mha if mha is not None and hasattr(mha, "get_fastpath_enabled") else None


def hold_fastpath_off() -> bool:
    """Switch MHA's fast path off until the matching :func:`release_fastpath`.

    Returns:
        whether this torch has the switch (False: nothing to release).
    """
    mha = _switch()
    if mha is None:
        return False
    with _lock:
        if _holders[0] == 0:
            _saved[0] = mha.get_fastpath_enabled()
            mha.set_fastpath_enabled(False)
        _holders[0] += 1
    return True


def release_fastpath() -> None:
    """Undo one :func:`hold_fastpath_off` (the last one restores the flag as the first one found it)."""
    mha = _switch()
    with _lock:
        _holders[0] -= 1
        if _holders[0] == 0 and mha is not None and _saved[0] is not None:
            mha.set_fastpath_enabled(_saved[0])
            _saved[0] = None
