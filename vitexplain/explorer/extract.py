"""What the explorer page shows of one image, computed in Python: the page data.

``image_data(explainer, image, ...)`` runs the model once under :func:`vitexplain.capture`
for the predictions and the attention views, then the Explainer for the method maps
(class-discriminative methods once per top-k class, class-agnostic ones once), and returns
one JSON-ready dict whose arrays are quantised (:mod:`.quantize`). Captioners are handled by
:mod:`.caption`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ..errors import VitexplainError
from ..targets import TargetSpec, logits_of, norm
from ..facade import find_layout_module
from ..methods import registry
from ..methods.context import Context
from ..recording import capture
from .attention import attention_views, prefix_labels
from .quantize import quantize_rows

__all__ = ["DEFAULT_METHODS", "image_data", "top_predictions", "method_entries", "explain_all"]

#: Methods shown by default: class-discriminative first, by the faithfulness table of
#: docs/benchmarks.md (pointing game on two-object shapes images), then class-agnostic
#: rollout. ``legrad`` (one backward pass per layer and class) is left to ``methods=``.
DEFAULT_METHODS: dict[str, tuple[str, ...]] = {
    "vit": ("generic", "grad_rollout", "cdam", "gradcam", "rollout"),
    "swin": ("generic", "grad_rollout", "cdam", "gradcam", "rollout"),
    "cnn": ("gradcam", "layercam", "gradcam++", "spatial", "channel"),
    "caption": ("cross", "cross_generic"),
}


def top_predictions(logits: Tensor, label_names: Optional[Sequence[str]], k: int, multi_label: bool) -> list[dict[str, Any]]:
    """The k best classes of one image.

    Args:
        logits: (C,) scores of one image.
        label_names: class names, or None.
        k: how many.
        multi_label: score with a sigmoid per class (multi-label models) instead of a softmax.

    Returns:
        ``[{"index": int, "label": str, "score": float}, ...]``, best first.
    """
    z = logits.detach().float().flatten()
    probs = torch.sigmoid(z) if multi_label else torch.softmax(z, dim=0)
    values, indices = probs.topk(min(k, probs.numel()))
    names = list(label_names or [])
    return [
        {"index": i, "label": names[i] if i < len(names) else str(i), "score": round(v, 4)}
        for v, i in zip(values.tolist(), indices.tolist())
    ]


def explain_all(run: Callable[..., Any], names: list[str], options: Mapping[str, Any], notes: list[str], strict: bool) -> dict[str, Any]:
    """Explanations of several methods from one call of ``run(method=..., **options)`` (an
    Explainer's ``explain`` or ``explain_caption`` with the target bound).

    With ``strict=False`` a method that does not apply to this model is left out with a note
    instead of failing the page.

    Returns:
        ``{method: explanation}``.
    """
    if not names:
        return {}
    per = {n: dict(options.get(n, {})) for n in names}
    try:
        if len(names) == 1:
            return {names[0]: run(method=names[0], **per[names[0]])}
        return dict(zip(names, run(method=names, **per)))
    except VitexplainError:
        if strict:
            raise
    out = {}
    for name in names:
        try:
            out[name] = run(method=name, **per[name])
        except VitexplainError as err:
            notes.append(f"{name} left out: {err}")
    return out


def method_entries(
    explainer: Any,
    x: Tensor,
    methods: Sequence[str],
    targets: list[Any],
    *,
    options: Mapping[str, Any],
    notes: list[str],
    strict: bool,
) -> list[dict[str, Any]]:
    """Per method, its maps: one row per target of ``targets`` (class-discriminative methods;
    class indices or any target the Explainer takes) or a single row (class-agnostic ones),
    each row the (gh * gw) map, quantised."""
    specs = {name: registry.get(name, explainer.family) for name in methods}
    sensitive = [n for n in methods if specs[n].class_sensitive]
    agnostic = [n for n in methods if not specs[n].class_sensitive]
    rows: dict[str, list[Tensor]] = {}
    for target in targets:
        got = explain_all(partial(explainer.explain, x, target=target), sensitive, options, notes, strict)
        sensitive = [n for n in sensitive if n in got]  # a method that failed once is left out
        for name, e in got.items():
            rows.setdefault(name, []).append(e.maps[0])
    for name, e in explain_all(partial(explainer.explain, x, target=targets[0] if targets else None), agnostic, options, notes, strict).items():
        rows[name] = [e.maps[0]]
    entries = []
    for name in methods:
        if name not in rows:
            continue
        maps = torch.stack(rows[name])  # (K, gh, gw)
        entries.append({
            "name": name,
            "summary": specs[name].summary,
            "perClass": specs[name].class_sensitive,
            "grid": list(maps.shape[-2:]),
            "maps": quantize_rows(maps.flatten(1), signed=specs[name].signed),
        })
    return entries


def _multi_label(model: Any) -> bool:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return bool(cfg.get("multi_label", False)) if isinstance(cfg, dict) else False


def image_data(
    explainer: Any,
    image: Any,
    name: str,
    *,
    methods: Optional[Sequence[str]] = None,
    options: Optional[Mapping[str, Any]] = None,
    top_k: int = 3,
    target: TargetSpec = None,
    attention_budget: int,
    max_len: int = 16,
) -> dict[str, Any]:
    """The page data of one image.

    Args:
        explainer: a :class:`vitexplain.Explainer` of the model.
        image: a path, PIL image or (H, W, 3) uint8 RGB array.
        name: the label shown for the image.
        methods: method names (None = :data:`DEFAULT_METHODS` of the family, leaving out the
            ones that do not apply to this model, with a note).
        options: per-method options, ``{method: {option: value}}``.
        top_k: classes offered for class-discriminative methods.
        target: None (the top-k classes), or one target for class-discriminative methods (a
            class index or label, or a score such as ``vx.targets.similarity(v)``). Headless
            backbones default to ``vx.targets.norm()``, with a note.
        attention_budget: most base64 bytes of attention views.
        max_len: longest caption generated (captioners).

    Returns:
        JSON-ready dict (see ``static/explore.js`` for how it is read).
    """
    from ..viz.notebook import png_data_uri

    x, regions, _, _ = explainer.preprocess(image)
    family = explainer.family
    strict = methods is not None
    names = list(methods) if methods is not None else [
        m for m in DEFAULT_METHODS[family] if m in registry.names(family)
    ]
    notes: list[str] = []
    data: dict[str, Any] = {
        "name": name,
        "family": family,
        "image": png_data_uri(regions[0]),
        "size": [int(x.shape[-2]), int(x.shape[-1])],
        "notes": notes,
        "attention": None,
        "caption": None,
        "methods": [],
    }
    if family == "caption":
        from .caption import caption_data

        data.update(caption_data(explainer, x, names, options or {}, notes, strict, attention_budget, max_len))
        return data
    vit = family == "vit"
    adapter = explainer.adapter
    with torch.no_grad(), capture(explainer.model, attention=vit) as rec:
        outputs = adapter.forward(x)
    predictions = (
        top_predictions(logits_of(outputs)[0], adapter.label_names, top_k, _multi_label(explainer.model))
        if adapter.has_head else []
    )
    if target is None and not adapter.has_head:
        target = norm()
        notes.append("no classifier head: the methods explain the norm of the embedding (vx.targets.norm()); "
                     "pass target= (e.g. vx.targets.similarity(vector)) for another score")
    if target is None:
        targets, data["targets"] = [p["index"] for p in predictions], predictions
    else:
        label = getattr(target, "__name__", None) if callable(target) else str(target)
        targets, data["targets"] = [target], [{"index": -1, "label": label or "target", "score": None}]
    data["predictions"] = predictions
    data["methods"] = method_entries(explainer, x, names, targets, options=options or {}, notes=notes, strict=strict)
    if family == "swin":
        notes.append("windowed attention (Swin): each layer attends inside local windows, so there is no single "
                     "query x key matrix to explore; the methods' maps are shown")
    if vit:
        layout = adapter.layout(tuple(x.shape[-2:]))
        if layout.windowed:
            notes.append("windowed attention (Swin-style): no attention views")
        else:
            try:
                layers = Context(adapter, x, outputs, None, rec, layout, method="explore").layers()
            except VitexplainError as err:
                notes.append(f"no attention views: {err}")
                return data
            owner = find_layout_module(explainer.model, tuple(x.shape[-2:]))[1]
            data["attention"] = attention_views(layers, layout, prefix_labels(owner, layout), notes, budget=attention_budget)
    return data
