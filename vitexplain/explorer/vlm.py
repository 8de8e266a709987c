"""The page data of a vision-language model: its answer word by word, over its image-token grids.

A VLM's image becomes one or more token grids (:class:`vitexplain.adapters.vlm.base.Piece`: the
whole image, or a thumbnail plus tiles), each over a box of the original image. The page gets:

* ``pieces``: per grid its name, (gh, gw), its first token, its box as fractions of the image and
  ``clamp`` (pixels past the box take the edge cells: the page draws such a grid one replicated
  cell larger on every side, clipped by the image) (each grid is a layer over its box, and can be hidden);
* per method (``cross``, ``cross_generic``, ...): the raw per-token scores of each word,
  (T, n) over the image's n pixel-bearing tokens in the model's order (``token_scores``);
* ``attention``: for each word, the language model's attention from the row that predicts it to
  the image tokens, per layer and head, (L, H, T, n), read from one teacher-forced forward on the
  model's fused attention (records recompute only those T rows: no N x N is kept). When
  ``L x H x T x n`` bytes exceed the budget, fewer layers (evenly spaced, always the last), then
  the head-mean, are embedded, and the page says so.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import numpy as np
import torch

from ..errors import CaptureError
from ..plan import Plan
from ..recording import capture
from .attention import layers_that_fit
from .methods import explain_all
from .quantize import payload_bytes, quantize_rows

__all__ = ["vlm_data", "vlm_attention"]


def vlm_attention(adapter: Any, inputs: Any, ids: torch.Tensor, *, budget: int,
                  view: Optional[Any] = None) -> Optional[dict[str, Any]]:
    """Attention of each answer word's predicting row over one image's tokens, per layer and head.

    Args:
        adapter: the VLM adapter.
        inputs: the processor's batch of one image (``adapter.prepare``).
        ids: (1, T) the answer ids.
        budget: most base64 bytes to embed.
        view: the image's token geometry; when given, only its pixel-bearing tokens are kept (the
            order of ``token_scores``: no newline tokens, no mllama class tokens).

    Returns:
        ``{"layers", "layerIndex", "heads", "probs": rows (L' * H' * T, n), "note"}`` (row
        ``(l * H' + h) * T + t``), or None when the model issued no language-model attention.
    """
    kwargs = adapter.teacher_inputs(inputs, ids)
    start = adapter.answer_start(inputs)
    t = int(ids.shape[1])
    with torch.no_grad(), capture(adapter.model) as rec:
        adapter.forward_logits(kwargs)
    layers = adapter.lm_records(rec.records)
    if not layers:
        return None
    columns = adapter.image_columns(kwargs)[0]
    if view is not None:
        columns = view.pixel_columns(columns)
    rows = torch.arange(start - 1, start - 1 + t, device=columns.device)
    n, heads = int(columns.numel()), layers[0].num_heads
    chosen = layers_that_fit(len(layers), heads * payload_bytes(t, n), budget)
    labels, note = [str(h) for h in range(heads)], ""
    if len(chosen) < len(layers):
        note = f"{len(chosen)} of {len(layers)} layers embedded (page budget {budget / 1e6:.1f} MB)"
    if not chosen:
        chosen = layers_that_fit(len(layers), payload_bytes(t, n), budget)
        labels = ["mean"]
        note = f"heads fused (mean) and {len(chosen)} of {len(layers)} layers embedded (page budget {budget / 1e6:.1f} MB)"
    out: dict[str, Any] = {"layers": [layers[i].name for i in chosen], "layerIndex": chosen, "heads": labels,
                           "words": t, "note": note, "probs": None}
    if chosen:
        kept = []
        for i in chosen:
            p = layers[i].probs(queries=rows)[0][..., columns]  # (H, T, n)
            kept.append(p.mean(0, keepdim=True) if labels == ["mean"] else p)
        out["probs"] = quantize_rows(torch.stack(kept).reshape(-1, n))
    rec.clear()
    return out


def vlm_data(explainer: Any, plan: Plan, image: np.ndarray, *, prompt: Optional[str], max_len: int,
             attention_budget: int, notes: list[str]) -> dict[str, Any]:
    """Answer, per-word token scores of each method, the token grids and the attention of one image.

    Args:
        explainer: an Explainer of a VLM (with its processor).
        plan: the methods to run.
        image: (H, W, 3) uint8 RGB.
        prompt: the prompt (None: the adapter's default).
        max_len: most tokens generated.
        attention_budget: most bytes of attention data.
        notes: the page's notes (appended to).

    Returns:
        ``{"predictions", "targets", "vlm": {"words", "prompt", "pieces", "methods", "attention"}}``.
    """
    adapter = explainer.adapter
    got = explain_all(partial(explainer.explain_caption, [image], prompt=prompt, max_len=max_len), plan, plan.names,
                      notes)
    if not got:
        raise CaptureError(f"no method could run on this model: {'; '.join(notes)}")
    first = next(iter(got.values()))
    words = list(first.tokens[0])
    t = max(len(words), 1)
    inputs = adapter.prepare([image], [first.prompts[0] if first.prompts else (prompt or "")])
    view = adapter.views([image], inputs)[0]
    h, w = view.size
    pieces = [{"name": p.name, "grid": list(p.grid), "start": p.start, "clamp": p.clamp,
               "box": [p.box[0] / h, p.box[1] / w, p.box[2] / h, p.box[3] / w]} for p in view.pieces]
    methods = []
    for name, e in got.items():
        spec = plan.step(name).spec
        scores = e.token_scores[0][:t].float()  # (T, n)
        methods.append({"name": name, "summary": spec.summary, "maps": quantize_rows(scores, signed=spec.signed)})
    attention = vlm_attention(adapter, inputs, first.ids[:, :t], budget=attention_budget, view=view)
    if attention is None:
        notes.append("the language model issued no attention call that vitexplain could see: no attention views")
    return {
        "predictions": [{"index": -1, "label": " ".join(words), "score": None}],
        "targets": [],
        "vlm": {"words": words, "prompt": first.prompts[0] if first.prompts else prompt, "pieces": pieces,
                "tokens": int(view.num_tokens), "methods": methods, "attention": attention},
    }
