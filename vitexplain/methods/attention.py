"""Class-agnostic attention maps: raw attention and attention rollout.

Both are computed from the captured q, k of each layer, recomputed in query blocks and
fused over heads as they go, and (rollout) by multiplying the readout row vector through
the layers: no (L, H, N, N) tensor and no N x N product is ever formed (except one fused
N x N matrix per image when ``discard_ratio`` > 0, which needs a global threshold).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ..capture import AttentionRecord
from ..capture.records import fuse_heads
from .context import Context, RowFn, query_blocks, readout_vector
from .registry import register

__all__ = ["raw", "rollout", "propagate", "discard_smallest"]


def discard_smallest(fused: Tensor, ratio: float, keep: Optional[int]) -> Tensor:
    """Zero the smallest ``ratio`` fraction of entries of each matrix (rollout's discard).

    Args:
        fused: (B, N, N) head-fused attention.
        ratio: fraction in [0, 1) of entries to zero, per image.
        keep: flat index never zeroed (the class->class entry), or None.

    Returns:
        (B, N, N) copy with the smallest entries zeroed (ties broken by position).
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {ratio}")
    flat = fused.flatten(1).clone()
    count = int(flat.shape[1] * ratio)
    if count == 0:
        return fused
    _, indices = flat.topk(count, dim=1, largest=False)
    values = torch.zeros_like(indices, dtype=flat.dtype)
    if keep is not None:
        # keep the class->class entry (every image keeps its own, unlike vit-explain)
        values = torch.where(indices == keep, flat.gather(1, indices), values)
    flat.scatter_(1, indices, values)
    return flat.view_as(fused)


def _mix_identity(rows: Tensor, block: slice, mode: str) -> Tensor:
    """Rollout's ``rownorm(0.5 * M + 0.5 * I)`` for a block of rows (B, n, N)."""
    if mode != "rollout":
        return rows
    n = rows.shape[1]
    index = torch.arange(block.start, block.start + n, device=rows.device)
    mixed = 0.5 * rows
    mixed[:, torch.arange(n, device=rows.device), index] += 0.5
    return mixed / mixed.sum(dim=-1, keepdim=True)


def propagate(
    vector: Tensor,
    layers: Sequence[AttentionRecord],
    rows_fn: RowFn,
    *,
    mode: str,
    discard_ratio: float = 0.0,
    keep: Optional[int] = None,
) -> Tensor:
    """Multiply a row vector through per-layer matrices, last layer first.

    ``mode="rollout"``: ``r <- r @ rownorm(0.5 * M_l + 0.5 * I)``, which yields the row of
    ``A_hat[L] @ ... @ A_hat[1]``. ``mode="generic"`` (Chefer): ``r <- r + r @ M_l``, the
    row of ``R`` after ``R = R + M_l @ R`` for l = 1..L. Each M_l is produced block by block
    by ``rows_fn``; blocks whose entries of ``r`` are all zero are skipped.

    Args:
        vector: (B, N) readout row.
        layers: the attention records, input side first.
        rows_fn: ``(record, rows) -> (B, n, N)`` fused rows of M_l.
        mode: ``"rollout"`` or ``"generic"``.
        discard_ratio: rollout's discard (needs one full fused N x N matrix per image).
        keep: flat index exempt from discarding (class->class), or None.

    Returns:
        (B, N) the propagated row.
    """
    r = vector
    for record in reversed(list(layers)):
        out = r.clone() if mode == "generic" else torch.zeros_like(r)
        if discard_ratio > 0:
            full = torch.cat([rows_fn(record, b) for b in query_blocks(record)], dim=1)
            full = discard_smallest(full, discard_ratio, keep)
            whole = slice(0, full.shape[1])
            out = out + torch.bmm(r.unsqueeze(1), _mix_identity(full, whole, mode)).squeeze(1)
        else:
            for block in query_blocks(record):
                weights = r[:, block]
                if not torch.any(weights):
                    continue
                rows = _mix_identity(rows_fn(record, block), block, mode)
                out = out + torch.bmm(weights.unsqueeze(1), rows).squeeze(1)
        r = out
    return r


def fused_rows(head_fusion: str) -> RowFn:
    """Rows of the head-fused attention probabilities."""

    def rows(record: AttentionRecord, block: slice) -> Tensor:
        return fuse_heads(record.probs(block), head_fusion)  # type: ignore[arg-type]

    return rows


@register(
    "raw",
    attention=True,
    class_sensitive=False,
    summary="raw attention of one layer (class-token row or mean over patch queries), one head or fused",
    reference="Dosovitskiy et al. 2021; references.md item 1",
)
def raw(ctx: Context, *, layer: int = -1, head: Optional[int] = None, head_fusion: str = "mean") -> Tensor:
    """Raw attention: the readout row of layer ``layer`` restricted to the patch keys.

    Args:
        ctx: the captured forward.
        layer: which layer (negative counts from the last).
        head: one head index, or None to fuse heads with ``head_fusion``.
        head_fusion: ``"mean"``, ``"max"`` or ``"min"``.

    Returns:
        (B, gh, gw) float32.
    """
    layers = ctx.layers()
    layout = ctx.require_grid()
    record = layers[layer]
    if head is not None and not -record.num_heads <= head < record.num_heads:
        raise ValueError(f"head {head} is out of range for {record.num_heads} heads")
    vector = readout_vector(layout, record.batch_size, record.device)
    out = torch.zeros_like(vector)
    for block in query_blocks(record):
        weights = vector[:, block]
        if not torch.any(weights):
            continue
        probs = record.probs(block)
        rows = probs[:, head] if head is not None else fuse_heads(probs, head_fusion)  # type: ignore[arg-type]
        out += torch.bmm(weights.unsqueeze(1), rows).squeeze(1)
    return layout.to_grid(out)


@register(
    "rollout",
    attention=True,
    class_sensitive=False,
    summary="attention rollout: product of rownorm(0.5 A + 0.5 I) over layers",
    reference="Abnar & Zuidema 2020; references.md item 2",
)
def rollout(ctx: Context, *, head_fusion: str = "mean", discard_ratio: float = 0.0, start_layer: int = 0) -> Tensor:
    """Attention rollout ``A_hat[L] @ ... @ A_hat[s]``, readout row, patch columns.

    ``A_hat[l] = rownorm(0.5 * fuse_h(A[l]) + 0.5 * I)``; with ``discard_ratio`` p the
    smallest fraction p of each image's fused entries are zeroed before adding I (the
    class->class entry is kept). Rows are normalised with keepdim and discard is applied
    to every image (the vit-explain bugs are not reproduced).

    Args:
        ctx: the captured forward.
        head_fusion: ``"mean"``, ``"max"`` or ``"min"``.
        discard_ratio: fraction of smallest entries to zero per layer and image.
        start_layer: first layer included (0 = all layers).

    Returns:
        (B, gh, gw) float32.
    """
    layers = ctx.layers()[start_layer:]
    layout = ctx.require_grid(rollout=True)
    vector = readout_vector(layout, ctx.batch_size, layers[0].device)
    keep = 0 if layout.readout == "class" and layout.has_class_token else None
    out = propagate(vector, layers, fused_rows(head_fusion), mode="rollout", discard_ratio=discard_ratio, keep=keep)
    return layout.to_grid(out)
