"""Attention computed by a model's own modules: additive, multiplicative, local, recurrent decoders.

Attention that is not a 4-D ``softmax`` or an SDPA / FlexAttention call (Bahdanau's
``v . tanh(W q + U k)``, Luong's ``q W k``, a windowed attention with its own normalisation,
an LSTM decoder that attends once per step) is declared by an *extractor*: a function that,
after the module has run, returns the attention weights it used::

    def extractor(module, inputs, output) -> AttentionWeights | Tensor | None:
        context, weights = output                   # e.g. a module returning (context, alpha)
        return AttentionWeights(weights, "cross")

    with vx.capture(model, attention={"decoder.attention": extractor}) as rec:
        model(x)

    vx.capture(model, attention={"decoder.attention": lambda m, i, o: o[1]})   # a plain tensor

or, for every instance of a module class, ``register_attention(MyAttention, extractor)``.
``inputs`` are the module's positional arguments (a tuple; its ``kwargs`` attribute holds the
keyword arguments) and ``output`` whatever its forward returned. :func:`from_output` and
:func:`from_attribute` build the common extractors.

The weights are (B, N_k) for a call with one query (a recurrent decoder step), (B, N_q, N_k),
or (B, H, N_q, N_k); records hold them as (B, H, N_q, N_k) and :meth:`AttentionRecord.probs`
returns them in float32, like an eager record. An extractor may return the weights tensor
alone: its kind is then decided from the module call as for every attention call the capture
sees (``is_cross_attention``, a tensor argument named ``encoder_hidden_states``, ``memory``, ...;
see :func:`vitexplain.recording.attribution.kind_of`), ``"self"`` otherwise; return
``AttentionWeights(weights, "cross")`` to state it. When the weights are the tensor the module's
output was computed from (not a recomputation, not detached) and gradients are captured,
``grad_probs()`` is the gradient reaching that tensor; otherwise (a view made in the extractor, such as
``weights.unsqueeze(1)``, is another tensor) it raises a clear error. Calls
of the same module count up ``step`` (a decoder attending once per generated word gives one
record per word, stitched by the caption methods like KV-cache steps). SDPA and softmax calls
issued inside a declared module are not recorded separately.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, Literal, NamedTuple, Optional, Union

import torch
from torch import Tensor, nn

from ..errors import CaptureError, InputError
from .attribution import call_kind
from .sink import Issuer, RecordSink, in_backward
from .witness import weights_witness

__all__ = [
    "AttentionWeights",
    "Extractor",
    "ModuleInputs",
    "register_attention",
    "unregister_attention",
    "registered_attention",
    "extractor_for",
    "extractor_for_class",
    "from_output",
    "from_attribute",
    "as_weights",
    "in_graph",
    "module_hook",
    "declared_modules",
]


class AttentionWeights(NamedTuple):
    """The attention weights one module call used, as returned by an extractor.

    Attributes:
        weights: (B, N_k) for one query (a recurrent decoder step), (B, N_q, N_k) or
            (B, H, N_q, N_k); row q holds the weights query q put on each key.
        kind: ``"self"`` (queries and keys from the same sequence) or ``"cross"`` (e.g. text
            queries over image keys).

    An extractor may return the weights tensor alone instead; its kind is then decided from
    the module call (see the module docstring).
    """

    weights: Tensor
    kind: Literal["self", "cross"]


class ModuleInputs(tuple):
    """The positional arguments of a module call; ``kwargs`` holds its keyword arguments."""

    kwargs: dict[str, Any]

    def __new__(cls, args: tuple, kwargs: Optional[dict[str, Any]] = None) -> "ModuleInputs":
        obj = super().__new__(cls, args)
        obj.kwargs = dict(kwargs or {})
        return obj


Extractor = Callable[[nn.Module, ModuleInputs, Any], Union[AttentionWeights, Tensor, None]]
"""``extractor(module, inputs, output) -> AttentionWeights | Tensor | None`` (None: no attention this call)."""

_REGISTRY: dict[type, Extractor] = {}


def register_attention(module_type: type, extractor: Optional[Extractor] = None) -> Any:
    """Declare where the attention weights of every instance of ``module_type`` are.

    Usable as a call, ``register_attention(Additive, extractor)``, or as a decorator,
    ``@register_attention(Additive)`` on the extractor. Subclasses match too (the nearest
    class in the MRO wins). Registering a class again replaces its extractor.

    Args:
        module_type: an ``nn.Module`` subclass.
        extractor: ``extractor(module, inputs, output) -> AttentionWeights | None``.

    Returns:
        The extractor (or, without one, a decorator that registers and returns it).
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise InputError(f"register_attention expects an nn.Module subclass, got {module_type!r}")

    def decorate(fn: Extractor) -> Extractor:
        if not callable(fn):
            raise InputError(f"the extractor for {module_type.__name__} must be callable, got {fn!r}")
        _REGISTRY[module_type] = fn
        return fn

    return decorate if extractor is None else decorate(extractor)


def unregister_attention(module_type: type) -> None:
    """Forget the extractor registered for ``module_type`` (no error if there is none)."""
    _REGISTRY.pop(module_type, None)


def registered_attention() -> list[str]:
    """Qualified names of the module classes with a registered extractor."""
    return [f"{c.__module__}.{c.__qualname__}" for c in _REGISTRY]


def extractor_for(module: nn.Module) -> Optional[Extractor]:
    """The registered extractor of ``module``'s class (nearest in the MRO), or None."""
    return extractor_for_class(type(module))


def extractor_for_class(module_type: type) -> Optional[Extractor]:
    """The registered extractor of the modules of class ``module_type`` (nearest in the MRO), or None."""
    for cls in module_type.__mro__:
        fn = _REGISTRY.get(cls)
        if fn is not None:
            return fn
    return None


def from_output(index: int = 1, kind: Literal["self", "cross"] = "cross") -> Extractor:
    """An extractor for modules that return their weights, e.g. ``(context, weights)``.

    Args:
        index: position of the weights in the returned tuple.
        kind: ``"self"`` or ``"cross"``.
    """

    def extract(module: nn.Module, inputs: ModuleInputs, output: Any) -> AttentionWeights:
        if not isinstance(output, (tuple, list)) or len(output) <= index:
            raise CaptureError(
                f"{type(module).__name__} returned {type(output).__name__}, not a tuple with the "
                f"attention weights at position {index}; write an extractor for it"
            )
        return AttentionWeights(output[index], kind)

    return extract


def from_attribute(name: str, kind: Literal["self", "cross"] = "cross") -> Extractor:
    """An extractor for modules that keep their last weights in an attribute (e.g. ``self.alpha``).

    Args:
        name: attribute holding the weights after each forward.
        kind: ``"self"`` or ``"cross"``.
    """

    def extract(module: nn.Module, inputs: ModuleInputs, output: Any) -> AttentionWeights:
        weights = getattr(module, name, None)
        if not isinstance(weights, Tensor):
            raise CaptureError(f"{type(module).__name__}.{name} is not a tensor after its forward")
        return AttentionWeights(weights, kind)

    return extract


def as_weights(result: Any, name: str) -> Optional[tuple[Tensor, Tensor, Optional[str]]]:
    """Check an extractor's result.

    Args:
        result: what the extractor returned.
        name: module name, for messages.

    Returns:
        None (no attention in this call), or (the weights tensor, its (B, H, N_q, N_k) view,
        kind); kind is None for a plain tensor (the caller decides it from the module call).

    Raises:
        CaptureError: the result is neither an :class:`AttentionWeights` with a valid kind nor
            a tensor, or the weights are not a 2- to 4-D float tensor.
    """
    if result is None:
        return None
    kind: Optional[str] = None
    if isinstance(result, Tensor):
        weights = result
    elif isinstance(result, tuple) and len(result) == 2:
        weights, kind = result
        if not isinstance(kind, str) or kind not in ("self", "cross"):
            said = repr(kind) if isinstance(kind, str) else f"a {type(kind).__name__}"
            raise CaptureError(
                f"the attention extractor of {name!r} returned a pair whose kind is {said}; return the weights "
                "tensor, or vitexplain.recording.AttentionWeights(weights, kind) with kind 'self' or 'cross'"
            )
    else:
        raise CaptureError(
            f"the attention extractor of {name!r} returned {type(result).__name__}; return the weights "
            "tensor, or vitexplain.recording.AttentionWeights(weights, kind) with kind 'self' or 'cross'"
        )
    if not isinstance(weights, Tensor) or weights.dim() not in (2, 3, 4) or not weights.is_floating_point():
        shape = f"shape {tuple(weights.shape)}" if isinstance(weights, Tensor) else type(weights).__name__
        dtype = f" {weights.dtype}" if isinstance(weights, Tensor) else ""
        raise CaptureError(
            f"the attention weights of {name!r} must be a float tensor shaped (B, N_k), (B, N_q, N_k) "
            f"or (B, H, N_q, N_k); got {shape}{dtype}"
        )
    if weights.dim() == 2:
        view = weights[:, None, None, :]
    elif weights.dim() == 3:
        view = weights[:, None]
    else:
        view = weights
    return weights, view, kind


def module_hook(sink: RecordSink, name: str, extractor: Extractor) -> Callable:
    """A forward hook (``with_kwargs=True``) recording the weights ``extractor`` reads from a declared module.

    Args:
        sink: where the record goes (the recorder).
        name: the module's name.
        extractor: ``extractor(module, inputs, output)``.
    """

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if in_backward() or not sink.in_scope_thread():  # (in_backward: a checkpointed forward recomputed,
            return  # recorded when it first ran; another thread's call of the model is not the capture's)
        inputs = ModuleInputs(args, kwargs)
        checked = as_weights(extractor(module, inputs, output), name)
        if checked is None:
            return
        weights, view, kind = checked
        b, h, n_q, n_k = view.shape
        record = sink.add_record(
            Issuer(name, module, sys._getframe()),
            kind=kind or call_kind(module, args, kwargs),
            source="module",
            q_shape=torch.Size((b, h, n_q, 0)),
            k_shape=torch.Size((b, h, n_k, 0)),
            _probs=view.detach(),
            **weights_witness(view),  # (a module may write its weights buffer again at its next call)
        )
        if sink.grads:
            if in_graph(weights, output, inputs) or not any(t.requires_grad for t in _tensors(output)):
                record._attach_grad_hook(weights, sink.hooks_enabled)  # (no graph at all: its state says so)
            else:  # the output is in a graph the weights are not in: detached, recomputed, or a view made after
                record._grad_state = "not_in_graph"

    return hook


def _tensors(value: Any) -> list[Tensor]:
    """The tensors in a (nested) module output."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def in_graph(weights: Tensor, output: Any, inputs: ModuleInputs) -> bool:
    """Whether the module's output was computed from ``weights`` (so dy/d weights is dy/dA).

    Walks the autograd graph back from the output tensors, not past the module's inputs.

    Args:
        weights: the tensor the extractor returned.
        output: the module's output.
        inputs: the module's inputs.
    """
    target = weights.grad_fn
    if target is None:
        return False
    outputs = _tensors(output)
    if any(t is weights for t in outputs):
        return True
    stop = {id(t.grad_fn) for t in (*_tensors(tuple(inputs)), *_tensors(inputs.kwargs)) if t.grad_fn is not None}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is target:
            return True
        if id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return False


def declared_modules(
    model: nn.Module, attention: Union[bool, dict[str, Extractor]], modules: Optional[dict[str, nn.Module]] = None,
    classes: Optional[Iterable[type]] = None,
) -> dict[str, tuple[nn.Module, Extractor]]:
    """The modules whose attention an extractor reads: named in ``attention`` or registered.

    Args:
        model: the captured model.
        attention: ``vx.capture``'s ``attention`` argument.
        modules: ``dict(model.named_modules())`` when the caller has it already.
        classes: the classes of those modules, when the caller has them already (when none has a
            registered extractor and none is named, no module is looked at).

    Returns:
        module name -> (module, extractor), in ``named_modules()`` order; the submodules of
        a declared module are not searched.

    Raises:
        CaptureError: a named module does not exist or its extractor is not callable.
    """
    explicit = dict(attention) if isinstance(attention, dict) else {}
    if not explicit and not _REGISTRY:  # nothing declared: no module to look for
        return {}
    if not explicit and classes is not None and not any(extractor_for_class(c) for c in classes):
        return {}
    modules = dict(model.named_modules()) if modules is None else modules
    missing = [n for n in explicit if n not in modules]
    if missing:
        raise CaptureError(
            f"no module named {missing} in {type(model).__name__} (attention={{...}}); module names "
            f"look like {list(modules)[1:6]} (see model.named_modules())"
        )
    for name, fn in explicit.items():
        if not callable(fn):
            raise CaptureError(f"the attention extractor for {name!r} must be callable, got {fn!r}")
    found: dict[str, tuple[nn.Module, Extractor]] = {}
    inside: Optional[str] = None
    for name, module in modules.items():
        if name in explicit:  # (a module named explicitly is declared even inside another declared one)
            found[name] = (module, explicit[name])
            if inside is None or not (inside == "" or name.startswith(inside + ".")):
                inside = name
            continue
        if inside is not None and (inside == "" or name.startswith(inside + ".")):
            continue
        fn = extractor_for(module) if _REGISTRY else None
        if fn is not None:
            found[name] = (module, fn)
            inside = name
    return found
