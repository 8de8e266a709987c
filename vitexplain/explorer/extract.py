"""What the explorer page shows of one image of a classifier (or headless backbone).

``classifier_data(explainer, plan, x, ...)`` runs the model once under :func:`vitexplain.capture`
for the predictions and, when the model's blocks issue token attention over a grid, the
attention views (hierarchical models: :mod:`.stages`, each layer on its stage grid); then the
plan's methods (:mod:`.methods`: class-discriminative ones once per
top-k class, class-agnostic ones once). It returns the JSON-ready part of the page data whose
arrays are quantised (:mod:`.quantize`). Captioners are handled by :mod:`.caption`;
:func:`vitexplain.explore` chooses between the two by the family's entry point.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from ..errors import NumericalError, VitexplainError
from ..adapters import find_layout_module
from ..methods.context import Context
from ..plan import Plan
from ..recording import capture
from ..targets import TargetSpec, logits_of, norm, resolve
from .attention import attention_views, prefix_labels
from .stages import stage_payload
from .methods import method_entries

__all__ = ["classifier_data", "top_predictions"]


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


def _multi_label(model: Any) -> bool:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return bool(cfg.get("multi_label", False)) if isinstance(cfg, dict) else False


def _given_target(target: Any, index: int, label_names: Optional[Sequence[str]]) -> dict[str, Any]:
    """The page's entry for the one target given: a class (``index`` >= 0) named by its label, as
    ``Explanation.target_names`` names it (a class index or tensor was shown as ``"2"`` or ``"tensor(2)"``), or
    a score function by its name."""
    if index >= 0:
        names = list(label_names or [])
        return {"index": index, "label": str(names[index]) if index < len(names) else str(index), "score": None}
    return {"index": -1, "label": getattr(target, "__name__", None) or "target", "score": None}


def classifier_data(explainer: Any, plan: Plan, x: Tensor, *, top_k: int, target: TargetSpec,
                    attention_budget: int, notes: list[str]) -> dict[str, Any]:
    """The page data of one image of a classifier or backbone.

    Args:
        explainer: a :class:`vitexplain.Explainer` of the model.
        plan: the page's plan (its methods and options).
        x: (1, 3, H, W) the preprocessed image.
        top_k: classes offered for class-discriminative methods.
        target: None (the top-k classes), or one target for class-discriminative methods (a
            class index or label, or a score such as ``vx.targets.similarity(v)``). Headless
            backbones default to ``vx.targets.norm()``, with a note.
        attention_budget: most base64 bytes of attention views.
        notes: the page's notes for this image (appended to).

    Returns:
        ``{"predictions", "targets", "methods", "attention"}`` (see ``static/explore.js``).
    """
    adapter = explainer.adapter
    views = "attention" in adapter.capabilities
    with torch.no_grad(), capture(explainer.model, attention=views) as rec:
        outputs = adapter.forward(x)
    scores = logits_of(outputs) if adapter.has_head else outputs
    if isinstance(scores, Tensor) and not bool(torch.isfinite(scores).all()):
        # (the default methods were each left out with a note, then the NaN predictions failed the page's JSON)
        raise NumericalError(
            "the model's outputs are not finite (NaN or inf) for this image, so no prediction or map would mean "
            "anything: check the image's preprocessing and the model's weights"
        )
    predictions = (
        top_predictions(logits_of(outputs)[0], adapter.label_names, top_k, _multi_label(explainer.model))
        if adapter.has_head else []
    )
    if target is None and not adapter.has_head:
        target = norm()
        notes.append("no classifier head: the methods explain the norm of the embedding (vx.targets.norm()); "
                     "pass target= (e.g. vx.targets.similarity(vector)) for another score")
    data: dict[str, Any] = {"predictions": predictions, "attention": None}
    if target is None:
        targets, data["targets"] = [p["index"] for p in predictions], predictions
    else:
        # a bad target (unknown label, index out of range) is the caller's error: raise it here,
        # before the default methods' failures would each be turned into a "left out" note
        resolved = resolve(target, outputs, adapter.label_names, has_head=adapter.has_head)
        data["targets"] = [_given_target(target, int(resolved.classes[0]), adapter.label_names)]
        targets = [target]
    data["methods"] = method_entries(explainer, x, plan, targets, notes)
    if views:
        layout = adapter.layout(tuple(x.shape[-2:]))
        if callable(getattr(adapter, "chain", None)):  # hierarchical: every layer on its own stage grid
            try:
                data["attention"] = stage_payload(adapter, rec.records, tuple(x.shape[-2:]),
                                                  prefix_labels(explainer.model, layout), budget=attention_budget,
                                                  batch=x.shape[0])
            except VitexplainError as err:
                notes.append(f"no attention views: {err}")
            return data
        if layout.windowed:
            notes.append("windowed attention (Swin-style): each layer attends inside local windows, so there is no "
                         "single query x key matrix to explore; the methods' maps are shown")
            return data
        try:
            layers = Context(adapter, x, outputs, None, rec, layout, method="explore").layers()
        except VitexplainError as err:
            notes.append(f"no attention views: {err}")
            return data
        owner = find_layout_module(explainer.model, tuple(x.shape[-2:]))[1]
        data["attention"] = attention_views(layers, layout, prefix_labels(owner, layout), notes, budget=attention_budget)
    return data
