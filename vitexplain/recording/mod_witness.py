"""What a FlexAttention ``score_mod`` or ``mask_mod`` reads, noted at the call to tell when its record is read whether
it still reads the same.

A FlexAttention record recomputes its probabilities by calling the call's ``score_mod`` and ``mask_mod`` again
(:mod:`vitexplain.recording.flex_records`). Those functions read values that are not their arguments:

- tensors they captured (a learned bias, a document-id table, a decoding offset written in place at every step,
  the way FlexAttention's guides keep compiled code from recompiling): closure cells, the module globals they name,
  the arguments of a ``functools.partial``;
- attributes of the objects they capture or are bound to: ``lambda s, b, h, q, k: s + self.bias[h, q - k]``
  written inside a module's ``forward``, a bound method ``score_mod=self.rel``, an ``nn.Module`` used as the
  score_mod, ``self.pos`` (a Python int a decoder advances after each call), ``self.cfg.window``.

Both are followed a few levels deep (a mask_mod wrapping a mask_mod wrapping one, as ``and_masks`` does). Tensors are
noted with their ``_version`` (how many in-place writes torch counted; a small inference tensor, which keeps no count,
is copied); the names read (a cell, a global, an attribute of an object: the names the function's code uses) are
noted with the value they held, a tensor by identity and a number or string by value. Reading the record checks both
(:func:`~vitexplain.recording.witness.changed_tensor`, :func:`changed_read`): a record whose mods would now read
something else is refused instead of recomputed from another call's values.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor, nn

from .witness import tensor_versions

__all__ = ["Read", "captured", "changed_read"]

_DEPTH = 3  # nested functions and attribute chains followed
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_MISSING = object()


class Read(NamedTuple):
    """A name a mod read when its call ran, and the value it held then.

    Attributes:
        where: a closure cell, a module's globals (a dict) or an object.
        name: the variable, global or attribute name.
        value: the value then (a tensor: that tensor object; a number or string: its value).
    """

    where: Any
    name: str
    value: Any

    def describe(self) -> str:
        """What was read, for messages: ``Decoder.pos``, ``global WINDOW``, ``captured variable pos``."""
        if isinstance(self.where, types.CellType):
            return f"captured variable {self.name}"
        if isinstance(self.where, dict):
            return f"global {self.name}"
        return f"{type(self.where).__name__}.{self.name}"


def _static_attr(obj: Any, name: str) -> Any:
    """``obj.name`` from its ``__dict__`` (and an ``nn.Module``'s parameters, buffers and submodules), without running
    a property or ``__getattr__``; ``_MISSING`` when it has none."""
    own = getattr(obj, "__dict__", None)
    if not isinstance(own, dict):
        return _MISSING
    if name in own:
        return own[name]
    if isinstance(obj, nn.Module):
        for store in ("_parameters", "_buffers", "_modules"):
            table = own.get(store)
            if table and name in table:
                return table[name]
    return _MISSING


def _current(read: Read) -> Any:
    """The value ``read`` names now (``_MISSING``: gone)."""
    where = read.where
    if isinstance(where, types.CellType):
        try:
            return where.cell_contents
        except ValueError:  # emptied
            return _MISSING
    if isinstance(where, dict):
        return where.get(read.name, _MISSING)
    return _static_attr(where, read.name)


def _names(code: Optional[types.CodeType]) -> tuple[str, ...]:
    """The global and attribute names ``code`` uses, with those of the functions defined in it."""
    if code is None:
        return ()
    nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return code.co_names + tuple(name for c in nested for name in c.co_names)


def _is_function(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, types.MethodType, functools.partial))


class _Walk:
    """Collects the tensors and the reads of the functions given to :func:`captured`."""

    def __init__(self) -> None:
        self.tensors: dict[int, Tensor] = {}
        self.reads: list[Read] = []
        self._seen: set[tuple[int, str]] = set()

    def function(self, fn: Any, depth: int) -> None:
        if depth > _DEPTH or fn is None:
            return
        if isinstance(fn, nn.Module):  # a module as the mod: its forward, bound to it
            fn = fn.forward
        elif not _is_function(fn) and callable(fn) and hasattr(fn, "__dict__"):
            fn = fn.__call__  # an object with a __call__ written in Python: bound to it
        if isinstance(fn, functools.partial):
            for value in (fn.func, *fn.args, *fn.keywords.values()):
                self.value(value, None, "", (), depth)
            return
        code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        names = _names(code)
        owner = getattr(fn, "__self__", None)  # a bound method's object: ``self.x`` reads its attributes
        if owner is not None and not isinstance(owner, types.ModuleType):
            self.value(owner, None, "", names, depth)
        cells = getattr(fn, "__closure__", None) or ()
        for name, cell in zip(getattr(code, "co_freevars", ()), cells):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self.value(contents, cell, name, names, depth)
        if isinstance(scope, dict):
            for name in dict.fromkeys(getattr(code, "co_names", ())):
                if name in scope:
                    self.value(scope[name], scope, name, names, depth)
        for value in getattr(fn, "__defaults__", None) or ():
            self.value(value, None, "", names, depth)

    def value(self, value: Any, where: Any, name: str, names: tuple[str, ...], depth: int) -> None:
        """A value a function reads (``where``/``name``: where it read it from, None when it was given)."""
        if where is not None and (isinstance(value, Tensor) or isinstance(value, _SCALARS)):
            key = (id(where), name)
            if key not in self._seen:
                self._seen.add(key)
                self.reads.append(Read(where, name, value))
        if isinstance(value, Tensor):
            self.tensors.setdefault(id(value), value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, Tensor):
                    self.tensors.setdefault(id(item), item)
                elif _is_function(item):
                    self.function(item, depth + 1)
        elif _is_function(value):
            self.function(value, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, (types.ModuleType, type)):
            self.attributes(value, names, depth)  # (a module's forward that called FlexAttention is not followed)

    def attributes(self, obj: Any, names: tuple[str, ...], depth: int) -> None:
        """The attributes of ``obj`` among ``names`` (the names the reading function uses)."""
        if depth > _DEPTH:
            return
        for name in dict.fromkeys(names):
            found = _static_attr(obj, name)
            if found is not _MISSING:
                self.value(found, obj, name, names, depth + 1)


def captured(*functions: Optional[Callable]) -> tuple[tuple[tuple[Tensor, Any], ...], tuple[Read, ...]]:
    """What ``functions`` read besides their arguments.

    Args:
        functions: a call's ``score_mod`` and ``mask_mod`` (None: none).

    Returns:
        (the tensors they read with their versions, as :func:`~vitexplain.recording.witness.tensor_versions`;
        the names they read with their values then, as :class:`Read`).
    """
    walk = _Walk()
    for fn in functions:
        walk.function(fn, 0)
    return tensor_versions(walk.tensors.values()), tuple(walk.reads)


def changed_read(reads: tuple[Read, ...]) -> Optional[Read]:
    """The first of ``reads`` whose name holds another value now (another number; another tensor, unless one equal
    to the noted one, e.g. a table the forward builds again at every call), or None."""
    for read in reads:
        now = _current(read)
        if now is read.value:
            continue
        if isinstance(read.value, Tensor) and isinstance(now, Tensor):
            same = (now.shape == read.value.shape and now.dtype == read.value.dtype
                    and now.device == read.value.device and bool(torch.equal(now, read.value)))
            if same:
                continue
            return read
        if isinstance(read.value, Tensor) or isinstance(now, Tensor) or type(now) is not type(read.value):
            return read
        if not now == read.value:
            return read
    return None
