"""One registry of explanation methods, read by the Explainer, the CLI and ``vx.methods.names()``.

The built-in methods are registered when :mod:`vitexplain.methods` is imported (every method
module, in a fixed order), so listings never depend on what was imported first, and a second
registration of a name raises unless ``override=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ..errors import UnsupportedMethodError, UsageError
from .options import Option, check_options as _check, describe_options, option_defaults

__all__ = ["MethodSpec", "register", "get", "names", "specs", "check_options", "FAMILIES"]

FAMILIES = ("vit", "swin", "cnn", "caption")


@dataclass(frozen=True)
class MethodSpec:
    """What a method is and what it needs from a capture.

    Attributes:
        name: the public method name (``"cdam"``, ``"rollout"``, ...).
        family: ``"vit"``, ``"swin"``, ``"cnn"`` or ``"caption"``.
        fn: ``fn(ctx, **options) -> maps`` (B, gh, gw), a pure function of a context; it may
            return ``(maps, extras)`` with a dict of method-specific results.
        grads: needs gradients of the target score (one backward pass).
        activations: given the model adapter, the module names whose inputs/outputs the
            capture must record.
        attention: needs attention records.
        gates: needs the CNN attention gates (``vx.capture(..., gates=True)``).
        signed: maps are signed (positive = evidence for the target); overlay with a
            diverging colormap centred at zero.
        class_sensitive: maps depend on the target class.
        retain_graph: keeps the autograd graph after the main backward (extra passes).
        dense_attention: reads every query row of every layer's attention probabilities (or
            their gradients); on a CPU the Explainer then lets the capture compute attention
            once instead of the fused kernel plus a recompute (``attention_mode="auto"``, see
            ``vitexplain.recording.materialize``).
        reads_fused: given the method's options, the head fusion (``"mean"``, ``"max"``,
            ``"min"``) through which alone it reads attention probabilities, or None when it
            reads single heads; when every requested method reads the same fusion and no
            gradient is taken, a materializing capture keeps only that fusion.
        requires: adapter capabilities the method needs (see ``vitexplain.adapters.base``);
            it applies to a model iff its adapter has all of them.
        summary: one line for listings.
        reference: paper or source the definition follows.
        options: the method's keyword options, each declared with its type and range.
        defaults: the options' defaults (from the function's signature).
    """

    name: str
    family: str
    fn: Callable[..., Any]
    grads: bool = False
    activations: Callable[[Any], list[str]] = field(default=lambda adapter: [])
    attention: bool = True
    gates: bool = False
    signed: bool = False
    class_sensitive: bool = True
    retain_graph: bool = False
    dense_attention: bool = False
    reads_fused: Callable[[Mapping[str, Any]], Optional[str]] = field(default=lambda options: None)
    requires: tuple[str, ...] = ()
    summary: str = ""
    reference: str = ""
    options: Mapping[str, Option] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def check_options(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Validate option values against this method's declared options.

        Raises:
            OptionError: an unknown option or a value out of its declared range.
        """
        return _check(self.name, self.options, self.defaults, values)

    def describe_options(self) -> str:
        """``name=default (allowed values)`` of every option, one string."""
        return describe_options(self.name, self.options, self.defaults)


_REGISTRY: dict[tuple[str, str], MethodSpec] = {}


def register(
    name: str,
    family: str = "vit",
    *,
    options: Optional[Mapping[str, Option]] = None,
    override: bool = False,
    **fields: Any,
) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` as method ``name`` of ``family`` (see :class:`MethodSpec`).

    Args:
        name: the public method name.
        family: ``"vit"``, ``"cnn"`` or ``"caption"``.
        options: one :class:`Option` per keyword option of ``fn`` (every keyword option must
            be declared, and nothing else).
        override: replace an existing method of the same name and family (otherwise a
            second registration raises).
        **fields: the other :class:`MethodSpec` fields.

    Raises:
        UsageError: unknown family, a name already registered (without ``override``), or
            declared options that do not match ``fn``'s keyword options.
    """
    if family not in FAMILIES:
        raise UsageError(f"unknown family {family!r}; choose from {FAMILIES}")
    if (family, name) in _REGISTRY and not override:
        raise UsageError(
            f"method {name!r} is already registered for {family} models; pass override=True to replace it"
        )
    declared = dict(options or {})

    def decorate(fn: Callable) -> Callable:
        defaults = option_defaults(fn)
        if set(defaults) != set(declared):
            raise UsageError(
                f"method {name!r}: declare every keyword option of {fn.__name__} with an Option "
                f"(keyword options {sorted(defaults)}, declared {sorted(declared)})"
            )
        summary = fields.pop("summary", None) or (fn.__doc__ or "").strip().splitlines()[0]
        _REGISTRY[(family, name)] = MethodSpec(
            name=name, family=family, fn=fn, summary=summary,
            options={k: declared[k] for k in defaults}, defaults=defaults, **fields,
        )
        return fn

    return decorate


def check_options(spec: MethodSpec, values: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``values`` against ``spec``'s declared options (see :meth:`MethodSpec.check_options`)."""
    return spec.check_options(values)


def specs(family: Optional[str] = None) -> list[MethodSpec]:
    """All registered method specs, optionally of one family, in registration order."""
    return [s for (fam, _), s in _REGISTRY.items() if family is None or fam == family]


def names(family: Any = None) -> list[str]:
    """Method names, optionally for one family or for a model.

    Args:
        family: None (all families), ``"vit"``/``"cnn"``/``"caption"``, or a model: then
            only the methods its adapter supports (``adapter.supports(spec)``).

    Returns:
        Method names, without duplicates, in registration order.
    """
    if family is not None and not isinstance(family, str):
        from ..adapters import adapter_for

        adapter = adapter_for(family)
        return list(dict.fromkeys(s.name for s in specs(adapter.family) if adapter.supports(s)))
    return list(dict.fromkeys(s.name for s in specs(family)))


def get(name: str, family: str) -> MethodSpec:
    """The spec of method ``name`` for ``family``; a clear error lists the alternatives."""
    spec = _REGISTRY.get((family, name))
    if spec is None:
        others = [fam for (fam, n) in _REGISTRY if n == name]
        hint = f" ({name!r} exists for {others} models)" if others else ""
        raise UnsupportedMethodError(
            f"method {name!r} is not available for {family} models{hint}; choose from {names(family)}"
        )
    return spec
