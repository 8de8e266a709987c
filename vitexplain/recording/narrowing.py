"""Where a capture intercepts torch calls: everywhere at first, then only where attention is issued.

A torch function mode costs a few microseconds on *every* torch call it sees, and a ``generate``
makes thousands of calls outside attention. So the capture's mode (:class:`AttentionMode`) is
active, in the capture's thread:

1. **Discovery.** From the start of the scope until the model's second forward starts (calls of
   the model itself, through ``__call__``), the mode sees every torch call, as a capture always
   did, except inside *layers*: modules of a class with several instances that hold submodules
   (the outermost such, e.g. ``LlamaDecoderLayer``, timm ``Block``). Once one layer of a class has
   run whole with the mode on, the next layers of that class run narrowed (below). Meanwhile the
   mode notes the classes of the modules that issued attention *not* through Hugging Face's
   attention interface, and which code ran (the code that made torch calls and its callers).
2. **Narrowed.** From the second forward on (and inside those layers), the mode is active only

   - inside every module of a class that issued attention outside the interface, or whose own
     forward names an attention function (SDPA, softmax, FlexAttention, MHA's functional
     forward): a forward pre-hook enters the mode, a forward hook with ``always_call=True``
     leaves it (timm ``Attention``, ``nn.MultiheadAttention``, eager Hugging Face attention, ...);
   - inside Hugging Face's attention function itself (``"sdpa"``, ``"flex_attention"``), through the
     registry's taps (:mod:`vitexplain.recording.interface`): only its reshapes and the attention
     call are seen;
   - inside every module whose forward code did not run before, for its first call, so that
     attention on a path not taken before (another tower, a branch, a layer unlike the others) is
     recorded; a class that issues attention there is then gated like the others.

   Modules of classes that ran without issuing attention outside the interface (MLPs, norms,
   embeddings; the generate loop's own torch calls) are not intercepted again.

What this cannot see, and full interception would: a module of a class that ran before without
issuing attention, whose forward names no attention function, and that issues attention outside
the interface through a helper, on a branch its earlier calls did not take (e.g. a layer whose
attention depends on its index, computed in a helper the layer calls); and a module of a gated class
called through ``module.forward(...)`` instead of ``module(...)``, which skips its hooks (Hugging Face
attention is seen at the interface either way).

Narrowing does not happen, and the mode stays on, when: the model itself issued attention (a bare
attention module, which could be called through ``.forward`` and skip the hooks), or its forward names an
attention function (it may issue attention on a branch its first forward did not take); no forward of the
model returned without raising; another torch function mode is above the capture's (e.g. LRP's
rules: the capture's mode must see calls after them, as at the bottom of the stack); or the model
is never called through ``__call__`` (``generate`` of BLIP-2 or Kosmos-2, which call their towers
and their LM's ``generate``: their layers are still narrowed). When the mode is entered later, it
goes back to its place on the stack, under any mode entered after the scope began. The records are
those of full interception (tests/test_capture_narrowing.py compares them for every kind of model
that runs several forwards).

A capture of a model that an earlier capture discovered starts narrowed (:mod:`~vitexplain.recording.discovery`
keeps what discovery learned while the model is unchanged), and inside the ``"sdpa"`` tap the record is
made from the attention function's arguments where that was checked (:mod:`~vitexplain.recording.direct`).
"""

from __future__ import annotations

import sys
import threading
from types import CodeType
from typing import Any, Callable, Iterable, Mapping, Optional

from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from . import discovery, interface
from .direct import DirectSDPA
from .attribution import never_issues
from .forwards import ATTENTION_NAMES, blocks, forward_code, inert
from .modestack import ModeStack
from .shared import HOOKS

__all__ = ["Narrowing"]


class Narrowing:
    """Decides where the capture's mode is active (see the module docstring). Owned by the recorder.

    Args:
        mode: the capture's mode.
        model: the captured model.
        direct: records tapped SDPA calls from their arguments where checked (None: always through the mode).

    Attributes:
        codes: code objects that made torch calls during discovery (None when not noting them).
        full: whether the mode is active everywhere now.
        narrowed: whether the last scope narrowed interception (kept after the scope).
        gated_types: the classes whose modules the mode was entered in after narrowing (kept after the scope).
    """

    def __init__(self, mode: TorchFunctionMode, model: nn.Module, direct: Optional[DirectSDPA] = None) -> None:
        self.model = model
        self.direct = direct
        #: whether the direct records' lanes are the learned entry's (set by the recorder: no extractor declared)
        self.share_lanes = False
        self.stack = ModeStack(mode)
        self.enabled = True
        self.full = False
        self.narrowed = False  # whether the last scope narrowed (kept after it, for tests and benchmarks)
        self.gated_types: set[type] = set()  # the classes the mode was entered in (kept after the scope)
        self.codes: Optional[dict[int, CodeType]] = None
        self._modules: Mapping[str, nn.Module] = {}
        self._names: Mapping[int, str] = {}  # id of each of the model's modules -> its name
        self._thread = 0
        self._depth = 0  # narrowed entries in progress (gates and taps)
        self._interface = 0  # tap calls in progress
        self._narrowed = False
        self._ready = False  # the first forward returned
        self._issuer_types: set[type] = set()  # classes that issued attention outside the interface
        self._gated: set[int] = set()
        self._gates: list[RemovableHandle] = []
        self._tripwires: dict[int, list[RemovableHandle]] = {}
        self._spent: list[int] = []  # tripwires that fired: removed at the next root forward
        self._pending: set[type] = set()  # issuer classes seen after narrowing: gated at the next root forward
        self._handles: list[RemovableHandle] = []
        self._block_handles: list[RemovableHandle] = []  # on the layers (see _blocks), until narrowing
        self._by_type: dict[type, list[nn.Module]] = {}
        self._named: Optional[set[type]] = None  # classes whose forward names an attention function
        self._known: set[type] = set()  # block classes one of whose calls ran fully intercepted
        self._calls: dict[int, list[str]] = {}  # block id -> what each call in progress did ("full", "suspended", "")
        self._key: Optional[tuple] = None  # the model's fingerprint at the start of the scope (discovery.py)
        self._recalled: Optional[discovery.Learned] = None  # what the scope started from, if anything
        self._discovered: Optional[dict[int, CodeType]] = None  # the codes known when narrowing began
        self._learned: dict[int, CodeType] = {}  # codes of modules that ran whole under a tripwire
        self._failed = False  # the last forward of the model raised

    # -- scope --------------------------------------------------------------------------
    def start(self, surveyed: discovery.Survey) -> None:
        """At the start of the scope: the mode everywhere (or narrowed at once when the model was
        discovered by an earlier capture, :mod:`~vitexplain.recording.discovery`); the interface's taps.
        The recorder says when the model's forward starts and ends (:meth:`root_started`, :meth:`root_ended`).

        Args:
            surveyed: the model's modules as the scope starts.
        """
        self._modules = surveyed.modules
        self._names = surveyed.names
        self._thread = threading.get_ident()
        self.narrowed = False
        self.gated_types = set()
        self.stack.start()
        self.stack.push()
        self.full = True
        if not self.enabled:
            return
        self._by_type = surveyed.by_type
        self._key = surveyed.key
        learned = self._recalled = discovery.recall(self.model, self._key)
        if learned is None:
            self.codes = self.stack.mode.codes = {}
            for block in blocks(self.model, self._by_type):
                self._block_handles.append(block.register_forward_pre_hook(self._block_pre, prepend=True))
                self._block_handles.append(block.register_forward_hook(self._block_post, always_call=True))
        interface.open_taps(self)
        self._handles.append(_Closer(self))
        if learned is not None:
            self._issuer_types |= learned.issuer_types
            self.codes = learned.codes  # read by _prepare only: the mode notes nothing
            if self.direct is not None and self.share_lanes:
                self.direct.use_lanes(learned.lanes)
            self._narrow()

    def stop(self, clean: bool = False) -> None:
        """At the end of the scope (also after an exception): the mode off, every hook and tap removed;
        what was learned about the model kept for its next capture when the scope ended ``clean``
        (without an exception) and the model's last forward did not raise."""
        try:
            if clean:
                self._remember()
            if self.full or self._depth > 0:
                self.full, self._depth = False, 0
                self.stack.pop()
        finally:
            for handle in (*self._handles, *self._block_handles, *self._gates,
                           *(h for hs in self._tripwires.values() for h in hs)):
                handle.remove()
            self._handles.clear()
            self._block_handles.clear()
            self._gates.clear()
            self._tripwires.clear()
            self._gated.clear()
            self._spent.clear()
            self._pending.clear()
            self._by_type = {}
            self._known.clear()
            self._calls.clear()
            self._named = None
            self.codes = self.stack.mode.codes = None
            self._key = self._discovered = self._recalled = None
            self._learned = {}
            self._failed = False
            self._interface = 0
            self._narrowed = self._ready = False

    def _remember(self) -> None:
        if self._key is None or self._failed:
            return
        recalled = self._recalled
        if recalled is not None and not self._learned and self._issuer_types <= recalled.issuer_types:
            return  # nothing new since the entry this scope started from
        codes = dict((self._discovered if self._narrowed else self.codes) or {})
        codes.update(self._learned)
        if codes:  # (nothing ran: nothing learned)
            discovery.remember(self.model, self._key, codes, self._issuer_types)

    # -- what the recorder and the taps tell it ------------------------------------------------
    def issued(self, module: nn.Module) -> None:
        """A record was made for ``module`` (its class is gated unless the call came through a tap)."""
        if self._interface == 0:
            kind = type(module)
            if kind not in self._issuer_types:
                self._issuer_types.add(kind)
                if self._narrowed:
                    self._pending.add(kind)

    def owns(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of the captured model's (for the interface's taps)."""
        return id(module) in self._names

    def through_interface(self, original: Callable, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """A Hugging Face attention function called for one of the model's modules, in this thread: with the
        mode on for its duration, or recorded from its arguments (:mod:`~vitexplain.recording.direct`)."""
        self._interface += 1
        try:
            if self.full or self._depth > 0:
                return original(module, *args, **kwargs)
            tap = sys._getframe(1)
            if self.direct is not None and tap.f_code is interface.TAP_CODE:  # (not several captures' taps in a chain)
                return self.direct.call(original, module, args, kwargs, tap.f_back, self._through_mode)
            return self._through_mode(original, module, args, kwargs)
        finally:
            self._interface -= 1

    def _through_mode(self, original: Callable, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        self._enter()
        try:
            return original(module, *args, **kwargs)
        finally:
            self._leave()

    # -- the mode in and out ------------------------------------------------------------------
    def _enter(self) -> None:
        if self._depth == 0 and not self.full:
            self.stack.push()
        self._depth += 1

    def _leave(self) -> None:
        self._depth -= 1
        if self._depth == 0 and not self.full:
            self.stack.pop()

    # -- hooks --------------------------------------------------------------------------
    def root_started(self) -> None:
        """The model's own forward starts, in the capture's thread (the recorder's hook on the model)."""
        if not self.enabled:
            return
        if self._narrowed:
            self._settle()
        elif self._ready and self.full:
            self._narrow()  # at the second forward, so that a capture of one forward pays nothing for it

    def root_ended(self, failed: bool) -> None:
        """The model's own forward ended; ``failed``: it raised (it may not have run every module)."""
        self._failed = failed
        self._ready = self._ready or not failed

    def _block_pre(self, module: nn.Module, args: tuple) -> None:
        """A layer/block of a class already seen whole: run it with the mode only where attention is issued."""
        if threading.get_ident() != self._thread:
            return
        state = ""
        if self.full and not self._narrowed:
            kind = type(module)
            if kind in self._known and kind not in self._issuer_types and self.stack.top_is_mode():
                self._prepare(list(module.modules())[1:])
                self.stack.pop()
                self.full, state = False, "suspended"
            else:
                state = "full"
        self._calls.setdefault(id(module), []).append(state)

    def _block_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if threading.get_ident() != self._thread or not self._calls.get(id(module)):
            return
        state = self._calls[id(module)].pop()
        if state == "suspended":
            self.full = True
            if self._depth == 0:
                self.stack.push()
        elif state == "full" and sys.exc_info()[0] is None:
            self._known.add(type(module))

    def _narrow(self) -> None:
        """At the second forward: the mode only where attention is issued (or stays on, see the module docstring)."""
        if not self.stack.top_is_mode() or type(self.model) in self._issuer_types:
            return
        code = forward_code(self.model)  # the model is never gated: one whose forward names attention stays full
        if code is not None and not ATTENTION_NAMES.isdisjoint(code.co_names):
            return
        self._prepare(self._modules.values(), whole=True)
        for handle in self._block_handles:  # (as the model's forward starts: no layer runs now)
            handle.remove()
        self._block_handles.clear()
        self.stack.pop()
        self.full, self._narrowed, self.narrowed = False, True, True
        self._discovered = self.codes
        self.codes = self.stack.mode.codes = None

    def _prepare(self, modules: Iterable[nn.Module], whole: bool = False) -> None:
        """Before ``modules`` run without the mode everywhere: gates on the classes that need one, and
        tripwires on those of ``modules`` whose code has not run (for a scope that started from a learned
        entry, decided once per entry: :attr:`discovery.Learned.prepared`)."""
        recalled = self._recalled if whole else None  # (whole: ``modules`` are all the model's)
        if recalled is not None and recalled.prepared is not None:
            self._named, tripwires = set(recalled.prepared[0]), recalled.prepared[1]
            self._gate(self._issuer_types | self._named)
            for name in tripwires:
                module = self._modules[name]
                if id(module) not in self._gated:
                    self._tripwires[id(module)] = self._hooks(module)
            return
        if self._named is None:  # classes whose forward calls an attention function itself
            self._named = set()
            for kind, instances in self._by_type.items():
                code = forward_code(instances[0])
                if code is not None and not ATTENTION_NAMES.isdisjoint(code.co_names):
                    self._named.add(kind)
        self._gate(self._issuer_types | self._named)
        codes = self.codes or {}
        ran: dict[type, bool] = {}  # by class: whether its forward ran (instances share it unless they have their own)

        def has_run(module: nn.Module) -> bool:
            code = forward_code(module)
            return code is not None and (codes.get(id(code)) is code or inert(code))

        placed = []
        for module in modules:
            key = id(module)
            if key in self._gated or key in self._tripwires or module is self.model:
                continue
            if "forward" in module.__dict__:
                known = has_run(module)
            else:
                known = ran.get(type(module))
                if known is None:
                    known = ran[type(module)] = has_run(module)
            if not known:
                self._tripwires[key] = self._hooks(module)
                placed.append(self._names[key])
        if recalled is not None:
            recalled.prepared = (frozenset(self._named), tuple(placed))

    def _settle(self) -> None:
        """At the start of a later forward: fired tripwires removed, newly seen issuer classes gated."""
        for key in self._spent:
            for handle in self._tripwires.pop(key, ()):
                handle.remove()
        self._spent.clear()
        if self._pending:
            kinds, self._pending = set(self._pending), set()
            self._gate(kinds)

    def _gate(self, kinds: Iterable[type]) -> None:
        for kind in kinds:
            if kind in self.gated_types:
                continue
            self.gated_types.add(kind)
            for module in self._by_type.get(kind, ()):
                if id(module) not in self._gated and module is not self.model:
                    self._gated.add(id(module))
                    self._gates.extend(self._hooks(module))

    def _hooks(self, module: nn.Module) -> list[RemovableHandle]:
        """A pre-hook that enters the mode (first, before other pre-hooks) and a hook that always leaves it."""
        entered: list[int] = [0]
        key = id(module)

        def pre(m: nn.Module, args: tuple) -> None:
            if threading.get_ident() != self._thread or self.full:
                return
            entered[0] += 1
            self._enter()
            if key in self._tripwires and key not in self._gated:
                self._spent.append(key)

        def post(m: nn.Module, args: tuple, output: Any) -> None:
            if threading.get_ident() != self._thread or entered[0] == 0:
                return
            entered[0] -= 1
            self._leave()
            if key in self._tripwires and sys.exc_info()[0] is None:  # it ran whole with the mode on
                code = forward_code(m)
                if code is not None:
                    self._learned[id(code)] = code

        with HOOKS:  # (see shared.py)
            return [module.register_forward_pre_hook(pre, prepend=True),
                    module.register_forward_hook(post, always_call=True)]


class _Closer:
    """A handle that closes the capture's taps (removed with the others)."""

    def __init__(self, owner: Narrowing) -> None:
        self.owner = owner

    def remove(self) -> None:
        if self.owner is not None:
            owner, self.owner = self.owner, None
            interface.close_taps(owner)


for _method in (Narrowing.through_interface, Narrowing._through_mode):  # between an HF attention module and SDPA
    never_issues(_method.__code__)
