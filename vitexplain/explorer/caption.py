"""The page data of a captioner: the generated words, per-word maps and encoder attention.

Per method (``cross``, ``cross_generic``) the page gets one row per word over the image
patches, (T, gh * gw), which is both the word's map and a row of the word x patch alignment
matrix. The image encoder's self-attention gets the same views as a ViT classifier's.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor

from ..errors import CaptureError
from ..adapters import find_layout_module
from ..adapters.captioning import model_runs_of
from ..plan import Plan
from ..recording import capture
from .attention import attention_views, prefix_labels
from .methods import entry, explain_all

__all__ = ["caption_data"]


def caption_data(explainer: Any, plan: Plan, x: Tensor, *, max_len: int, attention_budget: int,
                 notes: list[str]) -> dict[str, Any]:
    """Caption, per-word maps and encoder attention of one image (x: (1, 3, H, W)).

    Returns:
        ``{"predictions": [{"label": caption}], "caption": {"words": [...], "methods":
        [{"name", "summary", "grid", "maps": rows (T, gh * gw)}]}, "attention": ...}``.
    """
    adapter = explainer.adapter
    got = explain_all(partial(explainer.explain_caption, x, max_len=max_len), plan, plan.names, notes)
    entries, words, ids = [], None, None
    for name, e in got.items():
        words, ids = e.tokens[0], e.ids
        entries.append(entry(name, plan, e.maps[0, : max(len(words), 1)], per_class=False))  # (T, gh, gw)
    if ids is None:
        raise CaptureError(f"no caption method could run on this model: {'; '.join(notes)}")
    if not words:  # (its one all-zero row was drawn as "word 1 of 0", and a click on the alignment picked word -1)
        notes.append("the model ended its caption at once (its first token is the end of the caption): there is no "
                     "word to explain; the image encoder's attention is shown")
        entries = []
    out: dict[str, Any] = {
        "predictions": [{"index": -1, "label": " ".join(words or []), "score": None}],
        "targets": [],
        "caption": {"words": list(words or []), "methods": entries},
    }
    layout = adapter.layout(tuple(x.shape[-2:]))
    if layout.windowed:
        notes.append("windowed attention (Swin-style) in the image encoder: no attention views")
        return out
    with torch.no_grad(), capture(explainer.model) as rec, model_runs_of(adapter):
        adapter.teacher_forced(x, ids)
    layers = adapter.encoder_records(rec.records)
    if not layers:
        notes.append("the image encoder issued no self-attention call that vitexplain could see")
        return out
    encoder = explainer.model.get_submodule(adapter.encoder_prefix)
    owner = find_layout_module(encoder, tuple(x.shape[-2:]))[1]
    out["attention"] = attention_views(layers, layout, prefix_labels(owner, layout), notes, budget=attention_budget)
    return out
