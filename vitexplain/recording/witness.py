"""What a FlexAttention record notes of the tensors its ``score_mod`` and ``mask_mod`` read, to tell when it is read
whether they were written in place since the call.

A FlexAttention record recomputes its probabilities from the call's ``score_mod`` and ``mask_mod`` (see
:mod:`vitexplain.recording.flex`). Those functions often read tensors they captured: a learned bias, a document-id
table, or a decoding offset that the model writes in place at every step (the way FlexAttention's guides keep
compiled code from recompiling). A record read after such a write would recompute the attention of another call.
The tensors a function captures (its closure cells, the module globals it names, the arguments of a
``functools.partial``, and the same for the functions among those, a few levels deep) are noted with their
``_version`` (how many in-place writes torch counted; a small inference tensor, which keeps no count, is copied);
reading the record checks them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["captured_versions", "changed_tensor"]

_DEPTH = 3  # nested functions followed (a mask_mod wrapping a mask_mod wrapping one, as and_masks does)


def _captured(fn: Any, depth: int, found: dict[int, Tensor]) -> None:
    if depth > _DEPTH or fn is None:
        return
    values: list[Any] = []
    if isinstance(fn, functools.partial):
        values += [fn.func, *fn.args, *fn.keywords.values()]
    else:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is not None and isinstance(scope, dict):
            values += [scope[name] for name in code.co_names if name in scope]
        values += list(getattr(fn, "__defaults__", None) or ())
    for value in values:
        if isinstance(value, Tensor):
            found.setdefault(id(value), value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, Tensor):
                    found.setdefault(id(item), item)
                elif callable(item):
                    _captured(item, depth + 1, found)
        elif callable(value) and not isinstance(value, type):
            _captured(value, depth + 1, found)


#: An inference tensor (``torch.inference_mode``) keeps no count of its writes: one of at most this many elements
#: is copied instead, and compared when the record is read (larger ones are not witnessed).
COPY_ELEMENTS = 4096


def captured_versions(*functions: Optional[Callable]) -> tuple[tuple[Tensor, Any], ...]:
    """(tensor, its ``_version``, or a copy of it for a small inference tensor) for every tensor the functions
    capture."""
    found: dict[int, Tensor] = {}
    for fn in functions:
        _captured(fn, 0, found)
    noted: list[tuple[Tensor, Any]] = []
    for t in found.values():
        if not t.is_inference():
            noted.append((t, t._version))
        elif t.numel() <= COPY_ELEMENTS:
            noted.append((t, t.clone()))
    return tuple(noted)


def changed_tensor(versions: tuple[tuple[Tensor, Any], ...]) -> Optional[Tensor]:
    """The first noted tensor written in place since it was noted, or None."""
    for tensor, noted in versions:
        if isinstance(noted, Tensor):
            if not torch.equal(tensor, noted):
                return tensor
        elif tensor._version != noted:
            return tensor
    return None
