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
config: ``"eager"`` issues attention outside the interface), resolved to the same function by the
attention registries the model's classes read (a function registered in place of transformers' own,
or an entry of a registry's own mapping, is called without the capture's tap), and the same
train/eval mode. Anything else makes the capture discover again. A capture that narrowed still learns: code that
ran for the first time under its tripwires, and classes that issued attention there, are added.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

from torch import nn

from .interface import TAP_CODE

__all__ = ["Learned", "Survey", "survey", "fingerprint", "recall", "remember", "forget"]


@dataclass
class Learned:
    """What the captures of one model learned.

    Attributes:
        key: the model's :func:`fingerprint` when it was learned.
        codes: the code objects that ran with the mode on, by id (held, so ids are not reused).
        issuer_types: classes whose modules issued attention outside the interface.
        prepared: what narrowing decided from them, kept until they change: the classes whose
            forward names an attention function, and the names of the modules that get a tripwire.
        lanes: the Hugging Face SDPA calls whose records are made from their arguments without a plan per call
            (:mod:`vitexplain.recording.direct`), shared by the captures of the model that declare no extractor.
    """

    key: tuple
    codes: dict[int, CodeType] = field(default_factory=dict)
    issuer_types: frozenset[type] = frozenset()
    prepared: Optional[tuple[frozenset[type], tuple[str, ...]]] = None
    lanes: dict = field(default_factory=dict)


_MEMO: "weakref.WeakKeyDictionary[nn.Module, Learned]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _implementation(config: Any) -> Any:
    """A Hugging Face config's attention implementation (None for anything else)."""
    try:
        return getattr(config, "_attn_implementation", None)
    except Exception:  # a config-like object whose attribute access fails: nothing to compare
        return None


class Survey(NamedTuple):
    """What a capture reads of a model's modules as its scope starts, read in one walk (:func:`survey`).

    Attributes:
        modules: ``dict(model.named_modules())``.
        names: the id of each of those modules -> its name.
        by_type: each module class -> its modules, in ``named_modules()`` order.
        key: the model's :func:`fingerprint`.
        compiled: whether one of the modules is a ``torch.compile`` wrapper (``OptimizedModule``).
    """

    modules: dict[str, nn.Module]
    names: dict[int, str]
    by_type: dict[type, list[nn.Module]]
    key: tuple
    compiled: bool


def survey(model: nn.Module) -> Survey:
    """Read :class:`Survey` of ``model``: one pass over its modules, as ``named_modules()`` yields them (a capture
    opens once per batch, right after the model's work has left the modules out of the CPU's caches, so each pass
    over them costs; this is the only one).

    The walk notes each module's key under its parent and its depth (which give its name) rather than its name:
    the names are built only when those differ from the model's last survey (``_NAMES``), so a survey of an
    unchanged model makes no string and no name dict.
    """
    walked: list[nn.Module] = []
    entries: list[tuple] = []
    by_type: dict[type, list[nn.Module]] = {}
    configs: dict[int, Any] = {}
    seen: set[int] = set()
    compiled = False
    # pre-order, children in their order, each module once (at its first place), None children skipped: as
    # named_modules, without its generator per level (which it resumes for each module it yields below it)
    stack: list[tuple[nn.Module, str, int]] = [(model, "", 0)]
    pop, push = stack.pop, stack.append
    while stack:
        module, key, depth = pop()
        ident = id(module)
        if ident in seen:
            continue
        seen.add(ident)
        walked.append(module)
        kind = type(module)
        own = module.__dict__
        forward = own.get("forward")  # (an instance's own: held weakly, _weakly)
        entries.append((key, depth, ident, kind, kind.forward, forward if forward is None else _weakly(forward)))
        found = by_type.get(kind)
        if found is None:
            by_type[kind] = [module]
        else:
            found.append(module)
        children = module._modules
        # an OptimizedModule keeps its original in its __dict__ and its _modules (no nn.Module.__getattr__ miss)
        compiled = compiled or "_orig_mod" in own or "_orig_mod" in children
        config = own.get("config")
        if config is not None and id(config) not in configs:
            configs[id(config)] = _implementation(config)
        if children:
            below = depth + 1
            for child_key, child in reversed(children.items()):
                if child is not None:
                    push((child, child_key, below))
    walk = tuple(entries)
    known = _NAMES.get(model)
    if known is not None and known[0] == walk:
        # the last survey's own tuple: a learned key made from it then compares with this one by identity
        walk, ordered, names = known
    else:
        ordered, names = _names(walk)
        _NAMES[model] = (walk, ordered, names)
    key = (walk, tuple(configs.items()), _registries(by_type, configs.values()), model.training)
    return Survey(dict(zip(ordered, walked)), names, by_type, key, compiled)


class _Weak:
    """A module's own ``forward`` held weakly: equal to another exactly when both refer to the same live object (by
    identity, whatever the object's own ``==``); a dead one equals no other.

    The walk's entries are kept (a learned entry's key, ``_NAMES``) for as long as the model lives; an instance's
    forward is often a method bound to the module or a partial holding it (``model.forward = ...``, hook libraries),
    and kept strongly it would keep the model alive for ever from the entries the model is the weak key of."""

    __slots__ = ("ref", "_hash")

    def __init__(self, forward: Any) -> None:
        self.ref = weakref.ref(forward)  # (TypeError: an object without weak references)
        self._hash = id(forward)  # (equal ones refer to one object: the same id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Weak):
            return NotImplemented
        mine = self.ref()
        return mine is not None and mine is other.ref()

    def __hash__(self) -> int:
        return self._hash


def _weakly(forward: Any) -> Any:
    """``forward`` as the walk's entries keep it: :class:`_Weak`, or itself when it takes no weak reference."""
    try:
        return _Weak(forward)
    except TypeError:
        return forward


#: per model, its last survey's walk (keys, depths, identities, classes, forwards), the module names in walk order
#: and by module id: what a survey of the model unchanged since reuses (no module is held, only ids)
_NAMES: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, list[str], dict[int, str]]]" = \
    weakref.WeakKeyDictionary()


def _names(entries: Sequence[tuple]) -> tuple[list[str], dict[int, str]]:
    """The module names of a walk (its entries' keys and depths, pre-order), in order and by module id."""
    path: list[str] = []
    ordered: list[str] = []
    names: dict[int, str] = {}
    for key, depth, ident, *_ in entries:
        if depth:
            del path[depth - 1:]
            path.append(key)
        name = ".".join(path)
        ordered.append(name)
        names[ident] = name
    return ordered, names


def _untapped(function: Any) -> Any:
    """``function``, or the original a capture's tap (interface.py) stands for."""
    return getattr(function, "__wrapped__", function) if getattr(function, "__code__", None) is TAP_CODE else function


_EMPTY: Mapping[str, Any] = {}


def _registries(by_type: Mapping[type, Any], implementations: Iterable[Any]) -> tuple:
    """What the Hugging Face attention implementations in use resolve to, in every attention registry the
    model's classes read (their module's ``ALL_ATTENTION_FUNCTIONS``): the function, and whether it comes
    from that registry's own mapping (which the capture's taps never reach) or the shared one."""
    wanted = tuple(sorted({i for i in implementations if isinstance(i, str)}))
    if not wanted:
        return ()
    found: dict[int, tuple] = {}
    for name in dict.fromkeys([kind.__module__ for kind in by_type]):  # (each module once, in order)
        # the name as the classes' code reads it: a global of their module (its __dict__; a module __getattr__
        # is never asked for a global)
        registry = getattr(sys.modules.get(name), "__dict__", _EMPTY).get("ALL_ATTENTION_FUNCTIONS")
        if registry is None or id(registry) in found:
            continue
        own, shared = getattr(registry, "_local_mapping", None), getattr(registry, "_global_mapping", None)
        if isinstance(own, dict) and isinstance(shared, dict):
            found[id(registry)] = tuple((i, i in own, _untapped(own[i] if i in own else shared.get(i))) for i in wanted)
    return tuple(found.items())


def fingerprint(model: nn.Module) -> tuple:
    """What must not change for a learned entry to hold (see the module docstring): the modules'
    names, identities, classes and forwards, the Hugging Face attention implementations, train/eval."""
    return survey(model).key


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
