"""The method tabs of the explorer page: each planned method's maps, quantised.

Class-discriminative methods are run once per offered target (the top-k classes, or the one
target given), class-agnostic ones once. The methods come from the page's plan
(``Explainer.plan``): named methods must all run; the family's defaults that fail at run time
are left out with a note.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import VitexplainError
from ..plan import Plan, UnusedTargetWarning
from .quantize import quantize_rows

__all__ = ["explain_all", "method_entries", "entry", "MAX_MAP_SIDE"]

#: Maps finer than this per side (pixel-resolution maps, e.g. attnlrp's at 224 x 224) are
#: average-pooled to at most this many cells per side for the page (its size budget); the page
#: draws them over the image as it draws a patch grid.
MAX_MAP_SIDE = 112


def explain_all(run: Callable[..., Any], plan: Plan, names: list[str], notes: list[str]) -> dict[str, Any]:
    """Explanations of ``names`` (methods of ``plan``) from one call of ``run(method=..., **options)``
    (an Explainer's ``explain`` or ``explain_caption`` with the image and target bound).

    When the plan's methods were named, a failure raises; when they are the family's
    defaults, a method that fails is left out with a note instead of failing the page.

    Returns:
        ``{method: explanation}``.
    """
    if not names:
        return {}
    options = {n: dict(plan.step(n).options) for n in names}
    try:
        if len(names) == 1:
            return {names[0]: run(method=names[0], **options[names[0]])}
        return dict(zip(names, run(method=names, **options)))
    except VitexplainError:
        if plan.named:
            raise
    out = {}
    for name in names:
        try:
            out[name] = run(method=name, **options[name])
        except VitexplainError as err:
            notes.append(f"{name} left out: {err}")
    return out


def entry(name: str, plan: Plan, maps: Tensor, per_class: bool) -> dict[str, Any]:
    """The page entry of one method: its rows (K, n) quantised, with how to show them.

    ``maps`` (K, h, w); maps larger than :data:`MAX_MAP_SIDE` per side are average-pooled to fit."""
    spec = plan.step(name).spec
    h, w = maps.shape[-2:]
    if max(h, w) > MAX_MAP_SIDE:
        scale = MAX_MAP_SIDE / max(h, w)
        size = (max(1, int(h * scale)), max(1, int(w * scale)))
        maps = F.adaptive_avg_pool2d(maps[:, None].float(), size)[:, 0]
    return {
        "name": name,
        "summary": spec.summary,
        "perClass": per_class,
        "grid": list(maps.shape[-2:]),
        "maps": quantize_rows(maps.flatten(1), signed=spec.signed),
    }


def method_entries(explainer: Any, x: Tensor, plan: Plan, targets: list[Any], notes: list[str]) -> list[dict[str, Any]]:
    """Per planned method, its maps: one row per target of ``targets`` (class-discriminative
    methods; class indices or any target the Explainer takes) or a single row (class-agnostic
    ones), each row the (gh * gw) map, quantised."""
    sensitive = [s.name for s in plan.steps if s.spec.class_sensitive]
    agnostic = [s.name for s in plan.steps if not s.spec.class_sensitive]
    rows: dict[str, list[Tensor]] = {}
    for target in targets:
        got = explain_all(partial(explainer.explain, x, target=target), plan, sensitive, notes)
        sensitive = [n for n in sensitive if n in got]  # a method that failed once is left out
        for name, e in got.items():
            rows.setdefault(name, []).append(e.maps[0])
    first = targets[0] if targets else None  # (a headless model needs its target even here; it changes nothing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedTargetWarning)
        got = explain_all(partial(explainer.explain, x, target=first), plan, agnostic, notes)
    for name, e in got.items():
        rows[name] = [e.maps[0]]
    return [entry(s.name, plan, torch.stack(rows[s.name]), s.spec.class_sensitive)
            for s in plan.steps if s.name in rows]
