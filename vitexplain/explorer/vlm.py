"""The page data of a vision-language model: its answer word by word, over its image-token grids.

A VLM's image becomes one or more token grids (:class:`vitexplain.adapters.vlm.views.Piece`: the
whole image, or a thumbnail plus tiles), each over a box of the original image. The page gets:

* ``pieces``: per grid its name, (gh, gw), its first token, its box as fractions of the image and
  ``clamp`` (pixels past the box take the edge cells: the page draws such a grid one replicated
  cell larger on every side, clipped by the image) (each grid is a layer over its box, and can be hidden);
* per method (``cross``, ``cross_generic``, ...): the per-token scores of each word, (T, n) over
  the image's n pixel-bearing tokens in the model's order (``token_scores``; for a Q-Former or resampler model,
  whose image tokens in the sequence are learned queries, the scores the queries pass to the
  patches, :meth:`~vitexplain.adapters.vlm.base.VLMAdapter.to_pixel_tokens`);
* ``attention``: for each word, the language model's attention from the row that predicts it to
  the image tokens, per layer and head, (L, H, T, n) (a Q-Former model's: passed to the patches as
  the methods' scores are), read from one teacher-forced forward on the
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
from .attention import budget_text, layers_that_fit
from .methods import explain_all
from .quantize import payload_bytes, quantize_rows

__all__ = ["vlm_data", "vlm_attention", "pixel_token_scores"]


def _queries(view: Optional[Any]) -> bool:
    """The image's tokens in the sequence are not its pixel-bearing tokens (a Q-Former's or resampler's queries)."""
    return view is not None and view.sequence_tokens is not None


def pixel_token_scores(adapter: Any, inputs: Any, ids: torch.Tensor, view: Any,
                       scores: list[torch.Tensor]) -> list[torch.Tensor]:
    """Scores of one image's tokens in the sequence as scores of its pixel-bearing tokens (the page's grid).

    The identity, except for a Q-Former or resampler model (BLIP-2, InstructBLIP, Kosmos-2, Idefics2), whose
    sequence holds learned queries: their scores reach the patches through the cross-attention of a forward of
    the same image and prompt (:meth:`~vitexplain.adapters.vlm.base.VLMAdapter.to_pixel_tokens`, as the maps do).

    Args:
        adapter: the VLM adapter.
        inputs: the processor's batch of one image (``adapter.prepare``).
        ids: (1, T) the answer ids.
        view: the image's token geometry.
        scores: (T, n) scores over the image's tokens in the sequence, one per method.

    Returns:
        Per method, (T, view.num_tokens).
    """
    if not _queries(view) or not scores:
        return scores
    with torch.no_grad(), capture(adapter.model) as rec:
        adapter.forward_logits(adapter.teacher_inputs(inputs, ids))
    try:
        return [adapter.to_pixel_tokens([s], rec)[0] for s in scores]
    finally:
        rec.clear()


def vlm_attention(adapter: Any, inputs: Any, ids: torch.Tensor, *, budget: int,
                  view: Optional[Any] = None) -> Optional[dict[str, Any]]:
    """Attention of each answer word's predicting row over one image's tokens, per layer and head.

    Args:
        adapter: the VLM adapter.
        inputs: the processor's batch of one image (``adapter.prepare``).
        ids: (1, T) the answer ids.
        budget: most base64 bytes to embed.
        view: the image's token geometry; when given, only its pixel-bearing tokens are kept (the
            order of ``token_scores``: no newline tokens, no mllama class tokens), and a Q-Former's
            query columns are passed to the patches (:func:`pixel_token_scores`).

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
    heads = layers[0].num_heads
    n = int(view.num_tokens) if _queries(view) else int(columns.numel())  # (the columns drawn)
    chosen = layers_that_fit(len(layers), heads * payload_bytes(t, n), budget)
    labels, note = [str(h) for h in range(heads)], ""
    if len(chosen) < len(layers):
        note = f"{len(chosen)} of {len(layers)} layers embedded (page budget {budget_text(budget)})"
    if not chosen:
        chosen = layers_that_fit(len(layers), payload_bytes(t, n), budget)
        labels = ["mean"]
        note = f"heads fused (mean) and {len(chosen)} of {len(layers)} layers embedded (page budget {budget_text(budget)})"
    out: dict[str, Any] = {"layers": [layers[i].name for i in chosen], "layerIndex": chosen, "heads": labels,
                           "words": t, "note": note, "probs": None}
    if chosen:
        kept = []
        for i in chosen:
            p = layers[i].probs(queries=rows)[0][..., columns]  # (H, T, columns)
            p = p.mean(0, keepdim=True) if labels == ["mean"] else p
            if _queries(view):  # queries -> patches (linear: the mean over heads commutes with it)
                p = adapter.to_pixel_tokens([p.reshape(-1, p.shape[-1])], rec)[0].reshape(p.shape[0], t, n)
            kept.append(p)
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
    for piece, p in zip(pieces, view.pieces):
        if p.extent is not None:  # the piece's own part of the image (its grid's box reaches into padding past it)
            piece["extent"] = [p.extent[0] / h, p.extent[1] / w, p.extent[2] / h, p.extent[3] / w]
    methods = []
    ids = first.ids[:, :t]
    scores = pixel_token_scores(adapter, inputs, ids, view, [e.token_scores[0][:t].float() for e in got.values()])
    for name, score in zip(got, scores):  # (T, n) each
        spec = plan.step(name).spec
        methods.append({"name": name, "summary": spec.summary, "maps": quantize_rows(score, signed=spec.signed)})
    attention = vlm_attention(adapter, inputs, ids, budget=attention_budget, view=view)
    if attention is None:
        notes.append("the language model issued no attention call that vitexplain could see: no attention views")
    return {
        "predictions": [{"index": -1, "label": " ".join(words), "score": None}],
        "targets": [],
        "vlm": {"words": words, "prompt": first.prompts[0] if first.prompts else prompt, "pieces": pieces,
                "tokens": int(view.num_tokens), "methods": methods, "attention": attention},
    }
