"""One registry of explanation methods, read by the plan (:mod:`vitexplain.plan`), the CLI and
``vx.methods.names()``.

The built-in methods are registered when :mod:`vitexplain.methods` is imported (every method
module, in a fixed order), so listings never depend on what was imported first, and a second
registration of a name raises unless ``override=True``. Each method is registered under a
:class:`~vitexplain.methods.families.Family` and declares the adapter capabilities it needs
(``requires=``, names from :data:`CAPABILITIES`); which methods apply to a given model is the
plan's decision (``vx.Explainer(model).methods()``), not the registry's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from ..errors import UnsupportedMethodError, UsageError
from .families import Family, families, family as _family
from .options import Option, check_options as _check, describe_options, option_defaults

__all__ = ["MethodSpec", "register", "get", "names", "specs", "check_options", "CAPABILITIES"]

#: Every capability an adapter may declare and a method may require, with what it means (the
#: plan's refusal messages say which is missing and why).
CAPABILITIES: Mapping[str, str] = {
    "grid": "a single patch grid over the whole image",
    "tokens": "the tokens entering the model's last token attention",
    "attention": "token self-attention over the patch grid in every listed block",
    "rollout": "token attention in every block that mixes tokens (a full attention flow)",
    "readout": ("a head that reads the mean (or the class token) of the last tokens: the row the attention "
                "methods start from"),
    "tail": "re-running the model from its last block's input",
    "head": "reading the model's output from any block's tokens",
    "pixels": "a forward from pixels to a score",
    "stages": "(B, C, h, w) feature maps, one per image",
    "channel_gates": "channel attention gates (SE, ECA, CBAM, ...)",
    "spatial_gates": "spatial attention gates (CBAM-style)",
    "cross": "cross-attention from the text to the image tokens",
    "word_queries": ("a decoder cross-attention whose query rows are the caption's tokens, one per word (not several "
                     "query streams per token)"),
    "encoder_attention": ("an image encoder whose self-attention mixes one token set that the decoder reads (a ViT's), "
                          "or none (a CNN's)"),
    "lrp": ("every non-linearity from the pixels to the score is one the LRP rules cover: attention by "
            "scaled_dot_product_attention or nn.MultiheadAttention, LayerNorm/RMSNorm, element-wise activations"),
    "image_attention": ("attention of the language model's text positions over image tokens (in its own sequence or in "
                        "cross-attention layers), each image token mapped back to its pixels"),
}


@dataclass(frozen=True)
class MethodSpec:
    """What a method is and what it needs from a capture.

    Attributes:
        name: the public method name (``"cdam"``, ``"rollout"``, ...).
        family: the :class:`~vitexplain.methods.families.Family` the method explains.
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
        forward_rules: given the options and the model, a fresh context manager under which the model's forward
            and the target score run (LRP's rules); when the method is alone in a call, the
            Explainer's own forward runs under it with the input requiring grad, and the method
            finds the rules and the scores in ``ctx.shared`` (no second forward). None: none.
        summary: one line for listings.
        reference: paper or source the definition follows.
        options: the method's keyword options, each declared with its type and range.
        defaults: the options' defaults (from the function's signature).
    """

    name: str
    family: Family
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
    forward_rules: Optional[Callable[[Mapping[str, Any], Any], Any]] = None
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


_REGISTRY: dict[tuple[Family, str], MethodSpec] = {}


def register(
    name: str,
    family: Union[Family, str],
    *,
    options: Optional[Mapping[str, Option]] = None,
    override: bool = False,
    **fields: Any,
) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` as method ``name`` of ``family`` (see :class:`MethodSpec`).

    Args:
        name: the public method name.
        family: the :class:`~vitexplain.methods.families.Family` (or a registered family's name).
        options: one :class:`Option` per keyword option of ``fn`` (every keyword option must
            be declared, and nothing else); an option named like one of the family's
            conventions must be declared the same way.
        override: replace an existing method of the same name and family (otherwise a
            second registration raises).
        **fields: the other :class:`MethodSpec` fields.

    Raises:
        UsageError: unknown family or capability, a name already registered (without
            ``override``), declared options that do not match ``fn``'s keyword options, or an
            option that breaks the family's conventions.
    """
    family = _family(family)
    if (family, name) in _REGISTRY and not override:
        raise UsageError(
            f"method {name!r} is already registered for {family} models; pass override=True to replace it"
        )
    unknown = [c for c in fields.get("requires", ()) if c not in CAPABILITIES]
    if unknown:
        raise UsageError(f"method {name!r} requires unknown capabilities {unknown}; choose from {sorted(CAPABILITIES)}")
    declared = dict(options or {})
    for option_name, option in declared.items():
        family.check_convention(name, option_name, option)

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


def specs(family: Union[None, Family, str] = None) -> list[MethodSpec]:
    """All registered method specs, optionally of one family, in registration order."""
    fam = None if family is None else _family(family)
    return [s for (f, _), s in _REGISTRY.items() if fam is None or f is fam]


def names(family: Union[None, Family, str, Any] = None) -> list[str]:
    """Method names, of every family or of one.

    Args:
        family: None (every family), a :class:`~vitexplain.methods.families.Family` or its
            name (``"vit"``, ``"swin"``, ``"cnn"``, ``"caption"``, ...), or an
            :class:`~vitexplain.Explainer`: then the methods that apply to its model
            (``explainer.methods()``, the plan's answer).

    Returns:
        Method names, without duplicates, in registration order.

    Raises:
        NotFoundError: an unknown family name.
        UsageError: a model was passed: which methods apply to a model is decided by its
            plan, so ask ``vx.Explainer(model).methods()``.
    """
    if family is not None and not isinstance(family, (str, Family)):
        listing = getattr(family, "methods", None)
        if callable(listing) and hasattr(family, "plan"):
            return list(listing())
        raise UsageError(
            f"vx.methods.names() takes a family (one of {[f.name for f in families()]}) or an Explainer, got a "
            f"{type(family).__name__}; for the methods that apply to a model use vx.Explainer(model).methods() "
            "(or `vitexplain methods --model NAME`)"
        )
    return list(dict.fromkeys(s.name for s in specs(family)))


def get(name: str, family: Union[Family, str]) -> MethodSpec:
    """The spec of method ``name`` for ``family``; a clear error lists the alternatives."""
    fam = _family(family)
    spec = _REGISTRY.get((fam, name))
    if spec is None:
        others = [str(f) for (f, n) in _REGISTRY if n == name]
        hint = f" ({name!r} exists for {others} models)" if others else ""
        raise UnsupportedMethodError(
            f"method {name!r} is not available for {fam} models{hint}; choose from {names(fam)}"
        )
    return spec
