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

from ..recording import AttentionRecord
from .context import Context, RowFn, live_blocks, nonzero_rows, query_blocks
from .options import Option, check_index, check_head_or_fusion
from .families import VIT
from .registry import register
from ..errors import UsageError

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
        raise UsageError(f"discard_ratio must be in [0, 1), got {ratio}")
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


Weights = Callable[[Tensor], Tensor]
"""Maps the row sums (B, n) of a block of M to the weights (B, n) that multiply its rows."""
Contract = Callable[[AttentionRecord, slice, Weights], tuple[Tensor, Tensor]]
"""``(record, rows, weights_fn) -> (w @ M[rows] (B, N), w (B, n))`` with ``w = weights_fn(row sums)``."""


def contract_rows(rows_fn: RowFn) -> Contract:
    """A :data:`Contract` that materialises the fused rows (B, n, N) of M."""

    def contract(record: AttentionRecord, block: slice, weights: Weights) -> tuple[Tensor, Tensor]:
        rows = rows_fn(record, block)
        w = weights(rows.sum(dim=-1))
        return torch.bmm(w.unsqueeze(1), rows).squeeze(1), w

    return contract


def weighted_head_mean(w: Tensor, m: Tensor) -> Tensor:
    """``w @ mean_h(m)``: (B, n) weights, (B, H, n, N) rows -> (B, N).

    One batched matmul over (B, H) with ``w`` broadcast over heads; ``m`` is not copied.
    """
    return torch.matmul(w[:, None, None, :], m).squeeze(2).mean(dim=1)


def contract_mean_probs(record: AttentionRecord, block: slice, weights: Weights) -> tuple[Tensor, Tensor]:
    """``w @ mean_h(A)[rows]`` without materialising the head mean (or from the head mean
    that a materializing capture kept, ``record.heads == "mean"``)."""
    if record.heads == "mean":
        mean = record.fused_probs("mean", block)  # (B, n, N)
        sums = _ones(mean) if record.rows_sum_to_one else mean.sum(dim=-1)
        w = weights(sums)
        return torch.bmm(w.unsqueeze(1), mean).squeeze(1), w
    probs = record.probs(block)  # (B, H, n, N)
    # softmax rows: no pass over the block for the sums
    sums = _ones(probs[:, 0]) if record.rows_sum_to_one else probs.sum(dim=-1).mean(dim=1)
    w = weights(sums)
    return weighted_head_mean(w, probs), w


def _ones(rows: Tensor) -> Tensor:
    """(B, n) ones for (B, n, N) rows."""
    return torch.ones(rows.shape[0], rows.shape[1], device=rows.device)


def propagate(
    vector: Tensor,
    layers: Sequence[AttentionRecord],
    contract: Contract,
    *,
    mode: str,
    discard_ratio: float = 0.0,
    keep: Optional[int] = None,
    rows_fn: Optional[RowFn] = None,
    minus_identity: bool = False,
) -> Tensor:
    """Multiply a row vector through per-layer matrices M_l, last layer first.

    ``mode="rollout"``: ``r <- r @ rownorm(0.5 * M_l + 0.5 * I)``, which yields the row of
    ``A_hat[L] @ ... @ A_hat[1]``; computed as ``w = r / d`` with d the row sums of
    ``0.5 M + 0.5 I``, then ``0.5 w @ M + 0.5 w``, so ``0.5 M + 0.5 I`` is never formed.
    ``mode="generic"`` (Chefer): ``r <- r + r @ M_l``, the row of ``R`` after
    ``R = R + M_l @ R`` for l = 1..L. M_l is visited in query blocks; blocks whose entries
    of ``r`` are all zero are skipped.

    The row is carried as ``r = vector + dev``: only the deviation ``dev`` is accumulated, so
    increments far smaller than the readout vector's entries (gradient-weighted attention of
    an average-pooling model, whose readout is 1/N on every patch) are not rounded away.
    For rollout, ``r d^-1 (0.5 M + 0.5 I) - r = 0.5 w @ M - 0.5 w * rowsum(M)`` is added
    without forming the cancelling difference.

    Args:
        vector: (B, N) readout row v.
        layers: the attention records, input side first.
        contract: computes ``w @ M_l[rows]`` for a block of rows (see :data:`Contract`).
        mode: ``"rollout"`` or ``"generic"``.
        discard_ratio: rollout's discard (needs one full fused N x N matrix per layer,
            built with ``rows_fn``).
        keep: flat index exempt from discarding (class->class), or None.
        rows_fn: fused rows of M_l, required when ``discard_ratio`` > 0.
        minus_identity: return ``v (R - I)`` (the identity's share removed, see
            docs/methods.md, "Readout") instead of ``v R``.

    Returns:
        (B, N) the propagated row ``v R`` or ``v (R - I)``.
    """
    if mode not in ("rollout", "generic"):
        raise UsageError(f"unknown propagation mode {mode!r}")
    dev = torch.zeros_like(vector)
    for record in reversed(list(layers)):
        if discard_ratio > 0:
            if rows_fn is None:
                raise UsageError("discard_ratio needs rows_fn")
            full = torch.cat([rows_fn(record, b) for b in query_blocks(record)], dim=1)
            full = discard_smallest(full, discard_ratio, keep)
            blocks, layer_contract = [slice(0, full.shape[1])], contract_rows(lambda rec, b: full)
        else:
            blocks, layer_contract = list(query_blocks(record)), contract
        r = vector + dev
        out = dev.clone()
        for block in blocks:
            if discard_ratio == 0:
                block = nonzero_rows(r, block)
                if block is None:
                    continue
            r_block = r[:, block]
            if mode == "generic":
                product, _ = layer_contract(record, block, lambda sums: r_block)
                out += product
            else:
                # row i of 0.5 M + 0.5 I sums to 0.5 * sum_k M_ik + 0.5
                sums_seen: list[Tensor] = []

                def weights(sums: Tensor, r_block: Tensor = r_block) -> Tensor:
                    sums_seen.append(sums)
                    return r_block / (0.5 * sums + 0.5)

                product, w = layer_contract(record, block, weights)
                out += 0.5 * product
                out[:, block] -= 0.5 * w * sums_seen[0]
        dev = out
    return dev if minus_identity else vector + dev


def fused_rows(head_fusion: str) -> RowFn:
    """Rows of the head-fused attention probabilities."""

    def rows(record: AttentionRecord, block: slice) -> Tensor:
        return record.fused_probs(head_fusion, block)  # type: ignore[arg-type]

    return rows


@register(
    "raw", VIT,
    options={
        "layer": Option(int, help="layer index, negative counts from the last"),
        "head": Option(int, optional=True, help="one head, negative counts from the last (None = fuse heads)"),
        "head_fusion": Option(str, choices=("mean", "max", "min"), help="how heads are fused"),
    },
    attention=True,
    requires=("grid", "attention"),
    reads_fused=lambda options: options["head_fusion"] if options["head"] is None else None,
    class_sensitive=False,
    summary="raw attention of one layer (class-token row or mean over patch queries), one head or fused",
    reference="Dosovitskiy et al. 2021; docs/methods.md",
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
    record = layers[check_index(ctx.method, "layer", layer, len(layers), "layers")]
    check_head_or_fusion(ctx.method, head, head_fusion)
    if head is not None:
        head = check_index(ctx.method, "head", head, record.num_heads, "heads")
    vector = ctx.readout(layout, fusion=head_fusion if head is None else "mean")
    out = torch.zeros_like(vector)
    for rows in live_blocks(record, vector):  # only the readout rows (the class row: one)
        fused = record.probs(rows)[:, head] if head is not None else record.fused_probs(head_fusion, rows)  # type: ignore[arg-type]
        out += torch.bmm(vector[:, rows].unsqueeze(1), fused).squeeze(1)
    return layout.to_grid(out)


@register(
    "rollout", VIT,
    options={
        "head_fusion": Option(str, choices=("mean", "max", "min"), help="how heads are fused"),
        "discard_ratio": Option(float, low=0, high=1, high_open=True, help="fraction of smallest fused entries zeroed per layer"),
        "start_layer": Option(int, low=0, help="first layer included"),
    },
    attention=True,
    requires=("grid", "attention", "rollout"),
    class_sensitive=False,
    summary="attention rollout: product of rownorm(0.5 A + 0.5 I) over layers",
    reference="Abnar & Zuidema 2020; docs/methods.md",
    dense_attention=True,
    reads_fused=lambda options: options["head_fusion"],
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
    layers = ctx.layers(start_layer)
    layout = ctx.require_grid(rollout=True)
    vector = ctx.readout(layout, fusion=head_fusion)
    keep = 0 if layout.readout == "class" and layout.has_class_token else None
    rows = fused_rows(head_fusion)
    contract = contract_mean_probs if head_fusion == "mean" else contract_rows(rows)
    out = propagate(vector, layers, contract, mode="rollout", discard_ratio=discard_ratio, keep=keep, rows_fn=rows)
    return layout.to_grid(out)
