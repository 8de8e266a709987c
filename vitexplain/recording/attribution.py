"""Who issued an attention call: the module, whether it attends to another sequence, and which top-level call.

No hook is put on the model for this. When an attention call is seen, the Python stack is
walked from the frame that made it:

- the *issuer* is the nearest frame whose ``self`` is a submodule of the captured model (an
  ``nn.Softmax`` submodule is a tool of the attention module, not the issuer); calls from
  other models are not recorded;
- the *kind* is decided from the issuer and its arguments (:func:`kind_of`);
- the *top-level call* is the outermost call of a captured module on the stack (the frame of
  ``nn.Module._call_impl``): the model's own forward (known without a walk: the recorder's hooks
  on the model say when one is in progress, :meth:`Attribution.enter_root`), or a submodule that code outside the
  model called directly (e.g. the image encoder that Hugging Face ``generate`` runs through
  ``get_image_features`` before the first forward). Records are numbered by it
  (``record.forward_index``): 0 for the first top-level call that recorded attention, one more
  for each later one.
"""

from __future__ import annotations

import inspect
from types import CodeType, FrameType
from typing import Any, Iterable, Literal, Mapping, Optional

from torch import Tensor, nn

from .sink import Issuer

__all__ = ["Attribution", "never_issues", "kind_of", "frame_kind", "stable_kind", "call_kind", "is_inside", "CROSS_ARGUMENT_NAMES", "CROSS_PARAMETER_NAMES"]

#: Argument names that, when a tensor is passed, mean the keys come from another sequence.
CROSS_ARGUMENT_NAMES = (
    "encoder_hidden_states",
    "key_value_states",
    "memory",
    "context",
    "cross_attn_states",
    "cross_attention_states",
    "encoder_out",
)

#: Parameter names that only cross-attention modules declare: their keys come from that
#: argument or, when it is None at a decoding step, from the cache (Hugging Face Mllama, Dia, BLT).
CROSS_PARAMETER_NAMES = ("cross_attention_states",)

_CALL_IMPL = nn.Module._call_impl.__code__
_CROSS_PARAMETERS = frozenset(CROSS_PARAMETER_NAMES)


_SELF_CODES: dict[int, tuple[CodeType, bool]] = {}  # by id: generated code can hold unhashable constants


def _binds_self(code: CodeType) -> bool:
    """Whether frames of ``code`` can hold a local named ``self`` (an argument, a local or a closure cell)
    that may be the issuer (not the capture's own methods, see :func:`never_issues`)."""
    known = _SELF_CODES.get(id(code))
    if known is not None and known[0] is code:  # the code is held, so its id is not reused
        return known[1]
    binds = ("self" in code.co_varnames or "self" in code.co_freevars or "self" in code.co_cellvars) \
        and _NEVER.get(id(code)) is not code
    if len(_SELF_CODES) > 100_000:  # e.g. code generated again and again: start over rather than grow
        _SELF_CODES.clear()
    _SELF_CODES[id(code)] = (code, binds)
    return binds


_NEVER: dict[int, CodeType] = {}


def never_issues(code: CodeType) -> None:
    """Frames of ``code`` (the capture's own methods with a ``self``) are passed by the issuer search
    without reading their locals."""
    _NEVER[id(code)] = code


def _flag(module: nn.Module) -> Any:
    """``module.is_cross_attention``, or None (without nn.Module.__getattr__'s exception when it has none)."""
    if "is_cross_attention" in module.__dict__:
        return module.__dict__["is_cross_attention"]
    declared = getattr(type(module), "is_cross_attention", None)
    return declared if declared is None or isinstance(declared, bool) else getattr(module, "is_cross_attention", None)


def kind_of(module: nn.Module, arguments: Mapping[str, Any], parameters: Iterable[str]) -> Literal["self", "cross"]:
    """Whether an attention call issued by ``module`` is self- or cross-attention.

    ``"cross"`` when the module has ``is_cross_attention=True``, is an ``nn.MultiheadAttention``
    called with a key that is not its query, received a tensor argument named in
    :data:`CROSS_ARGUMENT_NAMES`, or declares a parameter named in :data:`CROSS_PARAMETER_NAMES`;
    otherwise ``"self"``.

    Args:
        module: the issuing module.
        arguments: the arguments of its call, by name.
        parameters: the parameter names of the called method.
    """
    flag = _flag(module)
    if isinstance(flag, bool):
        return "cross" if flag else "self"
    if isinstance(module, nn.MultiheadAttention):
        query, key = arguments.get("query"), arguments.get("key")
        return "cross" if isinstance(key, Tensor) and key is not query else "self"
    for arg in CROSS_ARGUMENT_NAMES:
        if isinstance(arguments.get(arg), Tensor):
            return "cross"
    return "cross" if not _CROSS_PARAMETERS.isdisjoint(parameters) else "self"


_LOCAL_KINDS: dict[int, tuple[CodeType, Optional[str]]] = {}  # by id, code held (see _binds_self)
_CROSS_NAMES = frozenset(CROSS_ARGUMENT_NAMES)


def _kind_without_locals(code: CodeType) -> Optional[str]:
    """What :func:`kind_of` answers from a frame of ``code`` whatever its locals hold, for a module that is
    not an ``nn.MultiheadAttention`` and has no ``is_cross_attention`` flag; None when a local named in
    :data:`CROSS_ARGUMENT_NAMES` could decide it."""
    known = _LOCAL_KINDS.get(id(code))
    if known is not None and known[0] is code:
        return known[1]
    names = (*code.co_varnames, *code.co_cellvars, *code.co_freevars)
    parameters = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    kind = None if not _CROSS_NAMES.isdisjoint(names) else "cross" if not _CROSS_PARAMETERS.isdisjoint(parameters) else "self"
    if len(_LOCAL_KINDS) > 100_000:
        _LOCAL_KINDS.clear()
    _LOCAL_KINDS[id(code)] = (code, kind)
    return kind


def frame_kind(module: nn.Module, frame: FrameType) -> Literal["self", "cross"]:
    """:func:`kind_of` for a call made while the module's method runs in ``frame`` (its locals are read
    only when a cross-attention argument name is among them)."""
    code = frame.f_code
    if not isinstance(module, nn.MultiheadAttention) and not isinstance(_flag(module), bool):
        kind = _kind_without_locals(code)
        if kind is not None:
            return kind  # type: ignore[return-value]
    return kind_of(module, frame.f_locals, code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])


def stable_kind(module: nn.Module, code: CodeType) -> Optional[Literal["self", "cross"]]:
    """:func:`frame_kind` for every call ``module`` makes from a frame of ``code``, when no frame's locals can
    change it (no ``nn.MultiheadAttention``, no cross-attention argument among the locals); else None."""
    if isinstance(module, nn.MultiheadAttention):
        return None
    flag = _flag(module)
    if isinstance(flag, bool):
        return "cross" if flag else "self"
    return _kind_without_locals(code)  # type: ignore[return-value]


def call_kind(module: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> Literal["self", "cross"]:
    """:func:`kind_of` for a finished module call (a forward hook's ``args`` and ``kwargs``)."""
    try:
        signature = inspect.signature(module.forward)
        arguments: Mapping[str, Any] = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature, or arguments it does not bind
        return kind_of(module, kwargs, ())
    return kind_of(module, arguments, signature.parameters)


def is_inside(name: str, declared: Mapping[str, Any]) -> bool:
    """Whether module ``name`` is a declared module or inside one."""
    return any(name == d or d == "" or name.startswith(d + ".") for d in declared)


class Attribution:
    """Finds the issuer and the top-level call of attention calls made inside one model.

    The numbering of top-level calls goes on over the scopes of one recorder (like ``step``);
    :meth:`start` tells it the model's modules at the start of each scope.
    """

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        self._declared: Mapping[str, Any] = {}
        self._top: Optional[object] = None  # a frame, or the token of the model's call in progress
        self._forward_index = -1
        self._root: Optional[object] = None  # a token for the model's own call in progress (enter_root)

    def enter_root(self) -> None:
        """The model's own (outermost) forward starts, in the capture's thread: it is the top-level call."""
        self._root = object()

    def exit_root(self) -> None:
        """The model's own (outermost) forward ended (also after an exception)."""
        self._root = None

    def start(self, names: Mapping[int, str], declared: Mapping[str, Any]) -> None:
        """Attribute calls to the model's modules from now on.

        Args:
            names: the id of each of the model's modules (``named_modules()``) -> its name.
            declared: names of the modules whose attention an extractor reads (calls inside
                them are recorded by the extractor, not here).
        """
        self._names = names
        self._declared = declared

    @property
    def names(self) -> Mapping[int, str]:
        """The id of each module of the model -> its name (from :meth:`start`)."""
        return self._names

    def issuer(self, start: Optional[FrameType]) -> Optional[Issuer]:
        """The innermost captured module on the stack from ``start``, with its frame."""
        names = self._names
        frame = start
        while frame is not None:
            if _binds_self(frame.f_code):  # reading f_locals builds a dict: only where a `self` can be
                obj = frame.f_locals.get("self")
                if obj is not None:
                    name = names.get(id(obj))
                    if name is not None and isinstance(obj, nn.Module) and not isinstance(obj, nn.Softmax):
                        return Issuer(name, obj, frame)
            frame = frame.f_back
        return None

    def issuer_of(self, module: nn.Module, frame: FrameType) -> Optional[Issuer]:
        """``module`` as the issuer of a call made from its method's ``frame``, known without a walk (the
        caller says which module issued it), or None when not recorded there (as :meth:`attention_issuer`)."""
        name = self._names.get(id(module))
        return Issuer(name, module, frame) if name is not None and not self._declared_inside(name) else None

    def attention_issuer(self, start: Optional[FrameType]) -> Optional[Issuer]:
        """The issuer of an SDPA/softmax/FlexAttention call, or None when it is not recorded there:
        calls from outside the model, and calls inside a declared module (whose record replaces them)."""
        issuer = self.issuer(start)
        return issuer if issuer is not None and not self._declared_inside(issuer.name) else None

    def _declared_inside(self, name: str) -> bool:
        """Whether module ``name`` is inside a declared module (an extractor records its attention)."""
        return bool(self._declared) and is_inside(name, self._declared)

    def forward_index(self, issuer: Issuer) -> int:
        """The number of the top-level call a record issued by ``issuer`` belongs to.

        The latest top-level frame is kept (frames are compared by identity, and keeping it
        prevents a later call's frame from reusing its address) until :meth:`stop`. While the model's
        own forward is in progress, that call is the top-level one (no frame is walked).
        """
        index = self.root_index()
        if index is not None:
            return index
        known = self._top if isinstance(self._top, FrameType) and self._top.f_code is _CALL_IMPL else None
        frame: Optional[FrameType] = issuer.frame
        while known is not None and frame is not None:  # first by identity only (no f_locals read)
            if frame is known:  # inside the current top-level call: nothing under it is a captured call
                return self._forward_index
            frame = frame.f_back
        top = None
        frame = issuer.frame
        while frame is not None:
            if frame.f_code is _CALL_IMPL and id(frame.f_locals.get("self")) in self._names:
                top = frame
            frame = frame.f_back
        top = top or issuer.frame  # a model method that computes attention inline, called directly
        if top is not self._top:
            self._top = top
            self._forward_index += 1
        return self._forward_index

    def root_index(self) -> Optional[int]:
        """The number of the top-level call in progress when it is the model's own forward (known without a
        walk), else None (see :meth:`forward_index`)."""
        if self._root is None:
            return None
        if self._root is not self._top:
            self._top = self._root
            self._forward_index += 1
        return self._forward_index

    def stop(self) -> None:
        """At the end of a scope: drop the kept frame (the next record starts a new top-level call)."""
        self._top = self._root = None

    def reset(self) -> None:
        """Number top-level calls from 0 again (``Recorder.clear()``)."""
        self._top = None
        self._forward_index = -1
