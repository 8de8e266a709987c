"""The explain plan: which methods run on a model, with which options and capture, or why not.

Every entry point asks the same question the same way: ``Explainer.explain`` and
``explain_caption``, ``vx.explore``, the batch commands (``vitexplain export``, ``caption``,
``explore``) and ``vitexplain methods --model``. :func:`make_plan` answers it from three
things only: the registry (what methods exist, what each needs), the model's adapter (its
family and capabilities, and why a capability is missing) and the request (method names and
options). Nothing else decides whether a method applies, and the refusal messages are built
here, once.

Example::

    ex = vx.Explainer(model)
    plan = ex.plan(method=["rollout", "cdam"], rollout={"discard_ratio": 0.9})
    plan.names            # ['rollout', 'cdam']
    plan.refused          # {'legrad': 'it does not provide ...', ...}: every method that does not apply
    print(plan)           # the same text as `vitexplain methods --model NAME`
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from .errors import OptionError, UnsupportedMethodError, UnsupportedModelError, UsageError
from .methods import registry
from .methods.families import Family, families
from .methods.registry import CAPABILITIES, MethodSpec
from .recording.materialize import check_mode

__all__ = ["Plan", "Step", "UnusedTargetWarning", "CaptureSettings", "make_plan", "applicable", "refusal", "split_options",
           "capture_settings", "describe_family", "describe_model"]

MethodArg = Union[None, str, Sequence[str]]


@dataclass(frozen=True)
class Step:
    """One method of a plan.

    Attributes:
        spec: the registered method.
        options: the options given for it, checked against its declared options (defaults
            are in ``spec.defaults``).
    """

    spec: MethodSpec
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class CaptureSettings:
    """What one capture must record for a set of methods (the arguments of ``vx.capture``).

    Attributes:
        grads: a backward pass of the target score is taken.
        activations: module names whose inputs/outputs are recorded.
        attention: attention calls are recorded.
        gates: CNN attention gates are recorded.
        retain_graph: the autograd graph is kept after the main backward.
        attention_mode: ``"auto"``, ``"fused"`` or ``"materialize"`` (see ``vx.capture``).
        heads: ``"all"``, or the one head fusion a materializing capture keeps.
    """

    grads: bool = False
    activations: tuple[str, ...] = ()
    attention: bool = False
    gates: bool = False
    retain_graph: bool = False
    attention_mode: str = "fused"
    heads: str = "all"

    def capture_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vx.capture`` (``retain_graph`` is the backward's)."""
        return {"grads": self.grads, "activations": list(self.activations), "attention": self.attention,
                "gates": self.gates, "attention_mode": self.attention_mode, "heads": self.heads}


class UnusedTargetWarning(UserWarning):
    """A class target was given to methods that do not read it (see :meth:`Plan.unused_target`)."""


@dataclass(frozen=True)
class Plan:
    """What explaining a model runs.

    Attributes:
        family: the model's family (its context, result type, defaults, conventions).
        model: the adapter's description of the model.
        steps: the methods that run, in order, with their checked options.
        capture: what one shared capture of all steps records.
        available: every method that applies to this model, in registry order.
        refused: every method of the family that does not apply, and why.
        skipped: methods left out of ``steps`` because they do not apply (only when no method
            was named and the family's defaults were used), and why.
        single: one method was named as a string (the caller returns one result, not a list).
        named: the methods were named by the caller (False: the family's defaults).
    """

    family: Family
    model: str
    steps: tuple[Step, ...]
    capture: CaptureSettings
    available: tuple[str, ...]
    refused: Mapping[str, str]
    skipped: Mapping[str, str] = field(default_factory=dict)
    single: bool = False
    named: bool = True

    @property
    def names(self) -> list[str]:
        """The method names of the steps, in order."""
        return [s.name for s in self.steps]

    @property
    def specs(self) -> list[MethodSpec]:
        return [s.spec for s in self.steps]

    def unused_target(self, target: Any) -> Optional[str]:
        """Why ``target`` changes nothing in this plan's maps (a target given while every method that
        runs is class-agnostic: raw attention, rollout, CNN gates), or None when a method reads it.

        Args:
            target: the ``target`` given to ``explain`` (None: the top prediction, nothing to say; a
                callable score: what a headless backbone needs for any method, nothing to say either).
        """
        if target is None or callable(target) and not hasattr(target, "shape") \
                or any(s.spec.class_sensitive for s in self.steps):
            return None
        sensitive = [n for n in self.available if registry.get(n, self.family).class_sensitive]
        instead = f"; to explain a class use {', '.join(sensitive)}" if sensitive else ""
        return (f"{', '.join(self.names)} {'does' if len(self.steps) == 1 else 'do'} not depend on the target class: "
                f"target={target!r} only labels the result (Explanation.targets), the maps are the same for any "
                f"class{instead}")

    def step(self, name: str) -> Step:
        """The step of method ``name``."""
        for s in self.steps:
            if s.name == name:
                return s
        raise UsageError(f"method {name!r} is not in this plan ({self.names})")

    def describe(self) -> str:
        """The plan as text: what runs, then the methods that apply (with summaries and
        options) and the ones that do not, with why."""
        runs = f"Runs: {', '.join(self.names)}" + (" (the family's defaults)" if not self.named else "")
        return runs + "\n" + describe_model(self.family, self.model, self.available, self.refused)

    def __str__(self) -> str:
        return self.describe()


def _spec_lines(spec: MethodSpec, width: int) -> list[str]:
    tag = " [signed]" if spec.signed and "signed" not in spec.summary else ""
    lines = [f"  {spec.name.ljust(width)}  {spec.summary}{tag}"]
    if spec.options:
        lines.append(f"  {''.ljust(width)}  options: {spec.describe_options()}")
    return lines


def describe_model(fam: Family, model: str, available: Sequence[str], refused: Mapping[str, str]) -> str:
    """Which methods apply to a model (with summaries and options) and which do not, with why:
    what ``vitexplain methods --model NAME`` prints."""
    specs = {s.name: s for s in registry.specs(fam)}
    width = max((len(n) for n in specs), default=0)
    defaults = [m for m in fam.defaults if m in available]
    lines = [f"{model} is a {fam.name} model ({fam.summary}).",
             f"Methods that apply ({len(available)}; default: {', '.join(defaults or available[:1]) or 'none'}):"]
    for name in available:
        lines.extend(_spec_lines(specs[name], width))
    if refused:
        lines.append(f"Methods that do not apply ({len(refused)}):")
        lines.extend(f"  {name.ljust(width)}  {why}" for name, why in refused.items())
    return "\n".join(lines)


def describe_family(fam: Family) -> str:
    """Every method of a family with its summary and options (``vitexplain methods --family``)."""
    specs = registry.specs(fam)
    width = max((len(s.name) for s in specs), default=0)
    lines = [f"{fam.name} methods: {fam.summary}" if specs else f"{fam.name} methods: (none registered)"]
    for spec in specs:
        lines.extend(_spec_lines(spec, width))
    return "\n".join(lines)


def refusal(adapter: Any, spec: MethodSpec) -> Optional[str]:
    """Why method ``spec`` does not apply to ``adapter``'s model, or None when it does.

    The reason names each missing capability, in the adapter's words when it gave them
    (``adapter.notes``), else from :data:`~vitexplain.methods.registry.CAPABILITIES`.
    """
    if spec.family is not adapter.family:
        hint = adapter.notes.get("family")
        return (f"a {spec.family.name} method; this is a {adapter.family.name} model"
                + (f" ({hint})" if hint else ""))
    missing = [c for c in spec.requires if c not in adapter.capabilities]
    if not missing:
        return None
    reasons = (adapter.notes.get(c) or f"it does not provide {CAPABILITIES.get(c, c)}" for c in missing)
    return "; ".join(dict.fromkeys(reasons))  # one reason given for several capabilities is said once


def applicable(adapter: Any) -> tuple[tuple[str, ...], dict[str, str]]:
    """The methods of ``adapter``'s family that apply to its model (registry order), and why
    each of the others does not."""
    candidates = registry.specs(adapter.family)
    refused = {s.name: why for s in candidates if (why := refusal(adapter, s)) is not None}
    return tuple(s.name for s in candidates if s.name not in refused), refused


def split_options(method: MethodArg, options: Mapping[str, Any]) -> tuple[MethodArg, dict[str, dict[str, Any]]]:
    """``**options`` of an API call as ``{method: {option: value}}``.

    One method named as a string takes its options directly (``discard_ratio=0.9``), or per method as
    several do (``rollout={...}``: no method has an option of its own name); with several (or none: the
    defaults), options are given per method.

    Raises:
        OptionError: with several methods, an option that is not ``name={...}``.
    """
    if isinstance(method, str):
        own = options.get(method)
        if isinstance(own, Mapping) and len(options) == 1:  # (it read as an option called 'rollout')
            return method, {method: dict(own)}
        return method, {method: dict(options)}
    bad = [k for k, v in options.items() if not isinstance(v, Mapping)]
    if bad:
        raise OptionError(
            "with several methods (or the default ones), pass options per method as name={...} "
            f"(e.g. rollout={{'discard_ratio': 0.9}}); got {bad}"
        )
    return method, {k: dict(v) for k, v in options.items()}


def capture_settings(specs: Sequence[MethodSpec], adapter: Any, options: Mapping[str, Mapping[str, Any]],
                     attention_mode: str) -> CaptureSettings:
    """What one capture must record for ``specs`` (see :class:`CaptureSettings`).

    ``attention_mode="auto"`` stays only when a method reads every layer's attention
    (otherwise the fused kernel plus a recompute of the few rows read is cheaper); without
    gradients, when every method reads attention through one head fusion, only that is kept.
    """
    grads = any(s.grads for s in specs)
    mode = check_mode(attention_mode)
    if mode == "auto" and not any(s.dense_attention for s in specs):
        mode = "fused"  # (with gradients the capture's auto keeps the kernel by itself)
    heads = "all"
    if mode != "fused" and not grads:
        fusions = {s.reads_fused({**s.defaults, **options.get(s.name, {})}) for s in specs if s.attention}
        if len(fusions) == 1 and None not in fusions:
            heads = fusions.pop()
    return CaptureSettings(
        grads=grads,
        activations=tuple(dict.fromkeys(a for s in specs for a in s.activations(adapter))),
        attention=any(s.attention for s in specs),
        gates=any(s.gates for s in specs),
        retain_graph=any(s.retain_graph for s in specs),
        attention_mode=mode,
        heads=heads,
    )


def make_plan(adapter: Any, method: MethodArg = None, options: Optional[Mapping[str, Mapping[str, Any]]] = None,
              *, attention_mode: str = "auto") -> Plan:
    """The plan for explaining ``adapter``'s model with ``method``.

    Args:
        adapter: the model's adapter (its ``family``, ``capabilities``, ``notes``).
        method: a method name, a list of names, or None for the family's defaults (those that
            do not apply are left out, in ``plan.skipped``; if none applies, the first method
            that does).
        options: ``{method: {option: value}}``, checked against each method's declared options.
        attention_mode: the capture's attention mode (``"auto"``, ``"fused"``, ``"materialize"``).

    Returns:
        The :class:`Plan`.

    Raises:
        UnsupportedMethodError: a named method is unknown, belongs to another family, or does
            not apply to this model (the message says why and lists the methods that apply).
        UnsupportedModelError: no method at all applies to this model.
        OptionError: options that are unknown, out of range, or given for a method not run.
    """
    fam: Family = adapter.family
    described = adapter.describe()
    available, refused = applicable(adapter)
    options = dict(options or {})
    skipped: dict[str, str] = {}
    if method is None:
        names = [m for m in fam.defaults if m in available]
        skipped = {m: refused[m] for m in fam.defaults if m in refused}
        if not names and available:
            names = [available[0]]
    else:
        if isinstance(method, (set, frozenset)):  # results come back in the order named; a set has none
            raise UsageError(f"method must be a method name or a list of names (results come back in that order); "
                             f"got a set {method!r}: pass a list")
        names = list(method) if isinstance(method, Iterable) and not isinstance(method, str) else [method]
        if any(not isinstance(n, str) for n in names):
            raise UsageError(f"method must be a method name or a list of names, got {method!r}; "
                             f"methods for this model: {list(available)}")
        twice = [n for n in dict.fromkeys(names) if names.count(n) > 1]
        if twice:  # one result per distinct name: results[i] would not be names[i]'s after a repeat
            raise UsageError(f"method {', '.join(map(repr, twice))} is named more than once in {names}; results "
                             "come back one per name, in the order named: name each method once")
        if not names:
            raise UsageError(f"no method given; choose from {list(available)}")
        for name in names:
            _check_named(name, fam, adapter, described, refused, available)
    if not names:
        grouped: dict[str, list[str]] = {}
        for n, why in refused.items():
            grouped.setdefault(why, []).append(n)
        raise UnsupportedModelError(
            f"no {fam.name} method applies to {described}: "
            + "; ".join(f"{', '.join(ns)}: {why}" for why, ns in grouped.items())
        )
    stray = [k for k in options if k not in names]
    if stray:
        raise OptionError(f"options given for {stray}, which {'is' if len(stray) == 1 else 'are'} not among the "
                          f"methods run {names}")
    specs = [registry.get(n, fam) for n in names]
    steps = tuple(Step(spec, spec.check_options(options.get(spec.name, {}))) for spec in specs)
    checked = {s.name: dict(s.options) for s in steps}
    return Plan(
        family=fam, model=described, steps=steps,
        capture=capture_settings(specs, adapter, checked, attention_mode),
        available=available, refused=refused, skipped=skipped, single=isinstance(method, str),
        named=method is not None,
    )


def _check_named(name: str, fam: Family, adapter: Any, described: str, refused: Mapping[str, str],
                 available: Sequence[str]) -> None:
    """Raise a clear error when the named method cannot run on this model."""
    if name in refused:
        raise UnsupportedMethodError(
            f"method {name!r} does not apply to {described}: {refused[name].rstrip('.')}. "
            f"Methods that apply: {list(available)}"
        )
    if name in available:
        return
    elsewhere = [f.name for f in families() if f is not fam and any(s.name == name for s in registry.specs(f))]
    if elsewhere:
        hint = adapter.notes.get("family")
        raise UnsupportedMethodError(
            f"method {name!r} is for {'/'.join(elsewhere)} models; {described} is a {fam.name} model "
            f"({fam.summary}). Methods that apply: {list(available)}" + (f". {hint}" if hint else "")
        )
    raise UnsupportedMethodError(
        f"unknown method {name!r}; methods that apply to {described}: {list(available)} "
        "(every method: vx.methods.names())"
    )
