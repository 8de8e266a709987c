"""The attention views of one image: per layer and head the attention matrix, and rollout.

For each self-attention layer l of a ViT (or a captioner's image encoder), the page gets the
probabilities ``A[l]`` (H, N, N), recomputed by the records from the fused kernel's q, k
(``AttentionRecord.probs``), and the cumulative rollout ``R_l = A_hat[l] @ ... @ A_hat[1]``
(N, N) with ``A_hat = rownorm(0.5 * mean_h(A) + 0.5 * I)`` (Abnar & Zuidema 2020; the same
definition as the ``rollout`` method, whose class row is ``R_L[cls]``). Row q of ``A[l]_h``
is what query token q attends to; row q of ``R_l`` is how token q at layer l draws on the
input tokens.

Each row is embedded in two parts, prefix keys and patch keys, each quantised with its own
scale (:mod:`.quantize`), so a query's attention over the patches keeps its full 8-bit
resolution even when most of the row's mass sits on the class token.

Size: ``L x H x N x N`` bytes for the matrices plus ``L x N x N`` for rollout (a 224 px
ViT-S/16: 197 tokens, 12 layers, 6 heads, about 4.4 MB as base64). When that exceeds
``budget``, fewer layers are embedded (evenly spaced, always the last), then only the
head-mean; the page says which.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..layout import TokenLayout
from ..recording import AttentionRecord
from .quantize import payload_bytes, quantize_rows

__all__ = ["rollout_matrices", "budget_text", "prefix_labels", "attention_payload", "attention_views", "layers_that_fit", "DEFAULT_ATTENTION_BUDGET_MB"]

#: MB of base64 the attention views of one image may take by default (a 224 px ViT-S page's
#: budget is 6 MB; the image, maps and script take the rest).
DEFAULT_ATTENTION_BUDGET_MB = 5.0


def budget_text(budget: int) -> str:
    """A page budget of ``budget`` bytes in MB, as the page's notes write it: ``5.0 MB``, and below 0.1 MB two
    significant digits (``0.002 MB``: a small budget was written ``0.0 MB``)."""
    mb = budget / 1e6
    return f"{mb:.1f} MB" if mb >= 0.1 else f"{mb:.2g} MB"


def rollout_matrices(fused: Sequence[Tensor], start: Optional[Tensor] = None) -> list[Tensor]:
    """Cumulative rollout after each layer.

    Args:
        fused: per layer, input side first, the head-mean attention (N, N).
        start: the rollout of the layers before ``fused`` (N, N), or None (the identity).

    Returns:
        Per layer l, ``R_l = A_hat[l] @ ... @ A_hat[1]`` (N, N) float32, with
        ``A_hat = rownorm(0.5 * A + 0.5 * I)``.
    """
    out: list[Tensor] = []
    r = start
    for a in fused:
        a = a.float()
        hat = 0.5 * a + 0.5 * torch.eye(a.shape[-1], device=a.device)
        hat = hat / hat.sum(dim=-1, keepdim=True)
        r = hat if r is None else hat @ r
        out.append(r)
    return out


def prefix_labels(model: nn.Module, layout: TokenLayout) -> list[str]:
    """Names of the prefix tokens: ``[CLS]``, ``[DIST]`` (DeiT distilled), ``[REG0]``...

    Args:
        model: the module that owns the tokens (timm keeps ``dist_token`` on it; Hugging Face DeiT a
            ``distillation_token`` on a submodule).
        layout: its token layout.
    """
    labels = ["[CLS]"] if layout.has_class_token else []
    # timm keeps dist_token on the model; Hugging Face DeiT its distillation_token on the embeddings (after the
    # class token too), which was labelled "[REG0]"
    if getattr(model, "dist_token", None) is not None or any(
            getattr(m, "distillation_token", None) is not None for m in model.modules()):
        labels.append("[DIST]")
    registers = layout.num_prefix_tokens - len(labels)
    return labels + [f"[REG{i}]" for i in range(registers)]


def attention_views(
    records: Sequence[AttentionRecord], layout: TokenLayout, prefix_names: list[str], notes: list[str], *, budget: int
) -> Optional[dict[str, Any]]:
    """:func:`attention_payload` of the layers in which every token attends to every token.

    Layers whose queries are the class token only (CaiT's and XCiT's class attention) have no
    row per patch to explore and are left out, with a note; None when no layer is left.
    """
    n = layout.num_tokens
    square = [r for r in records if r.num_queries == n and r.num_keys == n]
    if len(square) < len(records):
        notes.append(
            f"{len(records) - len(square)} of {len(records)} attention layers attend from the class token "
            "only (class attention); the attention views show the others"
            if square else "no attention layer attends from every token (class attention only): no attention views"
        )
    if not square:
        return None
    return attention_payload(square, layout, prefix_names, budget=budget)


def layers_that_fit(num_layers: int, per_layer: int, budget: int) -> list[int]:
    """Indices of at most ``budget // per_layer`` layers, spread evenly and always with the last."""
    fit = budget // max(per_layer, 1)
    if fit >= num_layers:
        return list(range(num_layers))
    if fit < 1:
        return []
    return sorted({int(round(i)) for i in np.linspace(num_layers - 1, 0, int(fit))})


def _split(rows: Tensor, prefix: int) -> dict[str, Any]:
    """Quantise (..., N) rows as their prefix-key and patch-key parts."""
    flat = rows.reshape(-1, rows.shape[-1])
    return {
        "prefix": quantize_rows(flat[:, :prefix]) if prefix else None,
        "patches": quantize_rows(flat[:, prefix:]),
    }


def _split_bytes(rows: int, n: int, prefix: int) -> int:
    return (payload_bytes(rows, prefix) if prefix else 0) + payload_bytes(rows, n - prefix)


def attention_payload(
    records: Sequence[AttentionRecord],
    layout: TokenLayout,
    prefix_names: list[str],
    *,
    budget: int = int(DEFAULT_ATTENTION_BUDGET_MB * 1e6),
    index: int = 0,
) -> dict[str, Any]:
    """The attention part of an image's page data.

    Args:
        records: one self-attention record per layer, input side first.
        layout: the token layout (not windowed).
        prefix_names: labels of the prefix tokens (:func:`prefix_labels`).
        budget: most base64 bytes to embed.
        index: which image of the records' batch.

    Returns:
        ``{"layers": [names], "layerIndex": [l], "heads": [labels], "prefix": P, "grid":
        [gh, gw], "probs": {"prefix", "patches"} rows (L', H', N) , "rollout": rows (L', N),
        "note": str}``; ``probs``/``rollout`` are None when nothing fits.
    """
    n, prefix = layout.num_tokens, layout.num_prefix_tokens
    heads = records[0].num_heads
    one_matrix = _split_bytes(n, n, prefix)
    chosen = layers_that_fit(len(records), (heads + 1) * one_matrix, budget)
    head_labels = [str(h) for h in range(heads)]
    note = ""
    if len(chosen) < len(records):
        note = f"{len(chosen)} of {len(records)} layers embedded (page budget {budget_text(budget)})"
    if not chosen:
        chosen = layers_that_fit(len(records), 2 * one_matrix, budget)
        head_labels = ["mean"]
        note = (
            f"heads fused (mean) and {len(chosen)} of {len(records)} layers embedded (page budget {budget_text(budget)})"
            if chosen else f"attention over {n} tokens does not fit the page budget ({budget_text(budget)})"
        )
    payload: dict[str, Any] = {
        "layers": [records[i].name for i in chosen],
        "layerIndex": chosen,
        "heads": head_labels,
        "prefix": prefix,
        "tokens": prefix_names,
        "grid": list(layout.grid or ()),
        "note": note,
        "probs": None,
        "rollout": None,
    }
    if not chosen:
        return payload
    kept, rolled = [], []
    r: Optional[Tensor] = None
    for i, record in enumerate(records[: chosen[-1] + 1]):
        probs = record.probs()[index]  # (H, N, N)
        r = rollout_matrices([probs.mean(dim=0)], start=r)[0]
        if i in chosen:
            kept.append(probs.mean(dim=0, keepdim=True) if head_labels == ["mean"] else probs)
            rolled.append(r)
    payload["probs"] = _split(torch.stack(kept), prefix)
    payload["rollout"] = _split(torch.stack(rolled), prefix)
    return payload
