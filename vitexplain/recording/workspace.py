"""Buffers for attention a capture computes itself, reused by the next capture of the same model.

A capture that materialises attention (``attention_mode="auto"`` on CPU, :mod:`.materialize`) allocates
each call's probabilities (B x H x N_q x N_k float32) and scratch for its chunks' scores. An
explanation drops them when its maps are made, and the next batch allocates them again: the C
allocator hands large blocks back to the OS and takes fresh pages, each first touched in the softmax
that fills it (a page fault per 4 KiB, ~3 us on the 2-core machine that runs the benchmarks). Measured
on the zoo's shapes-hier at batch 32 (``vitexplain export``'s batch), with the explain path's records
cleared when its maps are made: page faults per explanation 3,189 without a workspace, 78 with one;
CPU time of rollout over the plain forward, two alternating runs each, 1.46-1.50x and 1.26-1.28x.

A model's :class:`Workspace` (kept weakly per model, like :mod:`.discovery`'s entry: it goes with the
model) lends a buffer only when nothing else holds its storage: a record, a map or a view a caller
kept makes the next capture allocate anew (the storage's use count, read from torch). Its buffers
stay allocated between captures up to :data:`LIMIT_BYTES` per model; larger ones are allocated as
usual. Where torch does not expose the use count, or off CPU, nothing is pooled.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Callable, Optional

import torch
from torch import Tensor, nn

__all__ = ["Workspace", "workspace_for", "forget", "LIMIT_BYTES"]

#: Bytes a model's workspace keeps allocated between captures (more is allocated per call, as without one).
LIMIT_BYTES = 64 * 2**20


def _use_count_fn() -> Optional[Callable[[Tensor], int]]:
    """How many holders a tensor's storage has (tensors and views of it), or None where torch does not tell."""
    raw = getattr(torch._C, "_storage_Use_Count", None)
    if raw is None:
        return None

    def count(t: Tensor) -> int:
        return int(raw(t.untyped_storage()._cdata))

    try:  # a fresh tensor, then one view more: the count must tell them apart
        probe = torch.empty(1)
        alone = count(probe)
        view = probe.view(1)
        if count(view) != alone + 1:
            return None
        del view
        return count if count(probe) == alone else None
    except Exception:
        return None


_COUNT = _use_count_fn()
_ALONE = _COUNT(torch.empty(1)) if _COUNT is not None else 0


class Workspace:
    """Float buffers lent to the captures of one model (see the module docstring)."""

    def __init__(self, limit_bytes: int = LIMIT_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._buffers: list[Tensor] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialised tensor of ``shape`` with ``like``'s dtype and device: a free buffer of the same size
        when there is one, else a new one (kept for later while the workspace is within its limit)."""
        if _COUNT is None or like.device.type != "cpu":
            return like.new_empty(shape)
        numel = math.prod(shape)
        nbytes = numel * like.element_size()
        with self._lock:  # (a view is made before the lock is let go: another thread sees the buffer as taken)
            for buffer in self._buffers:
                if buffer.numel() == numel and buffer.dtype == like.dtype and _COUNT(buffer) == _ALONE:
                    return buffer.view(shape)
            if nbytes > self.limit_bytes:
                return like.new_empty(shape)
            held = sum(b.numel() * b.element_size() for b in self._buffers)
            if held + nbytes > self.limit_bytes:  # make room: drop free buffers of other sizes (an earlier batch's)
                self._buffers = [b for b in self._buffers if _COUNT(b) != _ALONE]
                held = sum(b.numel() * b.element_size() for b in self._buffers)
            if held + nbytes > self.limit_bytes:
                return like.new_empty(shape)
            buffer = torch.empty(numel, dtype=like.dtype)
            self._buffers.append(buffer)
            return buffer.view(shape)


_WORKSPACES: "weakref.WeakKeyDictionary[nn.Module, Workspace]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def workspace_for(model: Optional[nn.Module]) -> Optional[Workspace]:
    """``model``'s workspace (made on first use), or None without a model."""
    if model is None:
        return None
    with _lock:
        found = _WORKSPACES.get(model)
        if found is None:
            found = _WORKSPACES[model] = Workspace()
        return found


def forget(model: nn.Module) -> None:
    """Drop ``model``'s workspace: its free buffers are released (those still held stay with their holders)."""
    with _lock:
        _WORKSPACES.pop(model, None)
