"""One registry of explanation methods, read by the Explainer, the CLI and ``vx.methods.names()``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import UnsupportedMethodError

__all__ = ["MethodSpec", "register", "get", "names", "specs", "FAMILIES"]

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
        summary: one line for listings.
        reference: paper or source the definition follows.
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
    summary: str = ""
    reference: str = ""


_REGISTRY: dict[tuple[str, str], MethodSpec] = {}


def register(name: str, family: str = "vit", **fields: Any) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` as method ``name`` of ``family`` (see :class:`MethodSpec`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")

    def decorate(fn: Callable) -> Callable:
        summary = fields.pop("summary", None) or (fn.__doc__ or "").strip().splitlines()[0]
        _REGISTRY[(family, name)] = MethodSpec(name=name, family=family, fn=fn, summary=summary, **fields)
        return fn

    return decorate


def _load() -> None:
    """Import the modules that register methods (on first use, to keep imports light)."""
    from . import attention, gradients, tokens, legrad, captum_methods, swin  # noqa: F401  (listing order)

    try:
        from . import cnn  # noqa: F401
    except ImportError:  # pragma: no cover - optional family not present
        pass
    try:
        from . import caption  # noqa: F401
    except ImportError:  # pragma: no cover
        pass


def specs(family: Optional[str] = None) -> list[MethodSpec]:
    """All registered method specs, optionally of one family, in registration order."""
    _load()
    return [s for (fam, _), s in _REGISTRY.items() if family is None or fam == family]


def names(family: Any = None) -> list[str]:
    """Method names, optionally for one family or for a model.

    Args:
        family: None (all families), ``"vit"``/``"cnn"``/``"caption"``, or a model (its
            family is detected the way ``vx.Explainer`` detects it).

    Returns:
        Method names, without duplicates, in registration order.
    """
    if family is not None and not isinstance(family, str):
        from ..adapters import adapter_for

        family = adapter_for(family).family
    return list(dict.fromkeys(s.name for s in specs(family)))


def get(name: str, family: str) -> MethodSpec:
    """The spec of method ``name`` for ``family``; a clear error lists the alternatives."""
    _load()
    spec = _REGISTRY.get((family, name))
    if spec is None:
        others = [fam for (fam, n) in _REGISTRY if n == name]
        hint = f" ({name!r} exists for {others} models)" if others else ""
        raise UnsupportedMethodError(
            f"method {name!r} is not available for {family} models{hint}; choose from {names(family)}"
        )
    return spec
