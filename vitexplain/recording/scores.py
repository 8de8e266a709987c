"""Attention as ``F.scaled_dot_product_attention`` defines it, computed in float32 from a call's arguments.

What records (:mod:`vitexplain.recording.records`) and the capture's materialized calls
(:mod:`vitexplain.recording.materialize`) recompute: the masked scores, the probabilities (rows in
which every key is masked give zeros, as the fused kernels do), key heads repeated for
grouped-query attention, head fusion, and the selection of query rows (``queries=``).
"""

from __future__ import annotations

import math
from typing import Literal, Optional, Union

import torch
from torch import Tensor

from ..errors import CaptureError, UsageError

__all__ = ["QuerySelect", "Fusion", "attention_scores", "attention_probs", "score_scale", "masked_softmax", "fuse_heads"]

QuerySelect = Union[None, int, slice, Tensor]
"""Which query rows to compute: all (None), one index, a slice, or an index tensor."""

Fusion = Literal["mean", "max", "min"]


def _rows(selector: QuerySelect, n: int) -> Tensor | slice:
    """Normalise a query selector into something usable for indexing dim -2.

    Raises:
        UsageError: not an int, a slice or an integer/boolean index tensor, or an index out of range.
    """
    if selector is None:
        return slice(None)
    if isinstance(selector, slice):
        return selector
    if isinstance(selector, int) and not isinstance(selector, bool):
        if not -n <= selector < n:
            raise UsageError(f"query index {selector} is out of range for {n} queries")
        return slice(selector % n, selector % n + 1)
    if not isinstance(selector, Tensor) or selector.dim() != 1 or selector.is_floating_point() \
            or selector.is_complex():
        raise UsageError(
            f"queries must be None, an int, a slice or a 1-D integer or boolean index tensor, got {_described(selector)}"
        )
    if selector.dtype == torch.bool:
        if selector.numel() != n:
            raise UsageError(f"a boolean query mask must have one entry per query ({n}), got {selector.numel()}")
    elif selector.numel() and not bool(((selector >= -n) & (selector < n)).all()):
        raise UsageError(f"query indices {selector.tolist()} are out of range for {n} queries")
    return selector


def _described(value: object) -> str:
    """``value`` in an error message: a tensor by its shape and dtype, anything else by its repr."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return repr(value)


def _select_mask_rows(mask: Tensor, rows: Tensor | slice, n_q: int) -> Tensor:
    """Select query rows of a mask broadcastable to (..., N_q, N_k)."""
    if mask.dim() >= 2 and mask.shape[-2] == n_q and n_q > 1:
        return mask[..., rows, :]
    return mask


def attention_scores(
    q: Tensor,
    k: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    is_causal: bool = False,
    queries: QuerySelect = None,
) -> Tensor:
    """The masked scores ``q k^T * scale + mask`` of ``F.scaled_dot_product_attention``, in float32.

    Follows SDPA: default scale ``1 / sqrt(E)``; a boolean mask marks positions that take
    part (True) and a float mask is added; ``is_causal`` masks with a top-left aligned
    lower-triangular (N_q, N_k) mask; grouped-query attention (fewer key heads) repeats key
    heads. One batched matmul scaled by the GEMM itself (``baddbmm`` with ``alpha``), the
    masks applied in place: no other pass over the (..., n, N_k) result.

    Args:
        q: (..., H, N_q, E) queries, any float dtype.
        k: (..., H_kv, N_k, E) keys; H must be a multiple of H_kv.
        attn_mask: bool or float mask broadcastable to (..., H, N_q, N_k).
        scale: score scale; None means ``1 / sqrt(E)``.
        is_causal: apply SDPA's causal mask.
        queries: which query rows to compute (None = all).

    Returns:
        (..., H, n, N_k) float32 scores, ``-inf`` where masked.
    """
    n_q, n_k = q.shape[-2], k.shape[-2]
    rows = _rows(queries, n_q)
    qf = q[..., rows, :].float()
    kf = _repeat_heads(k.float(), qf.shape[-3])
    scale = score_scale(q, scale)
    if qf.shape[:-2] == kf.shape[:-2]:
        batch = math.prod(qf.shape[:-2])  # (not -1: ambiguous when N_q or N_k is 0)
        q3, k3 = qf.reshape(batch, *qf.shape[-2:]), kf.reshape(batch, *kf.shape[-2:])
        scores = torch.baddbmm(q3.new_zeros(()), q3, k3.transpose(1, 2), beta=0.0, alpha=scale)
        scores = scores.view(*qf.shape[:-1], n_k)
    else:  # broadcast batch dims
        scores = torch.matmul(qf * scale, kf.transpose(-2, -1))
    if is_causal:
        causal = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        scores.masked_fill_(~causal[rows], float("-inf"))
    if attn_mask is not None:
        mask = _select_mask_rows(attn_mask, rows, n_q)
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores += mask.float()
    return scores


def score_scale(q: Tensor, scale: Optional[float]) -> float:
    """SDPA's score scale: ``scale``, or ``1 / sqrt(E)`` when it is None."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def masked_softmax(scores: Tensor, masked: bool) -> Tensor:
    """Softmax over the last dim; with ``masked``, rows in which every key is masked give
    zeros (and zero gradients), as the fused SDPA kernels do, instead of NaN."""
    if not masked:
        return torch.softmax(scores, dim=-1)
    safe = getattr(torch, "_safe_softmax", None)  # SDPA's own math path uses it
    if safe is not None:
        return safe(scores, -1)
    return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)


def attention_probs(
    q: Tensor,
    k: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    is_causal: bool = False,
    queries: QuerySelect = None,
) -> Tensor:
    """Recompute ``softmax(q k^T * scale + mask)`` exactly as SDPA defines it, in float32.

    Scores as :func:`attention_scores` (same arguments); rows in which every key is masked
    come out as zeros instead of NaN.

    Returns:
        (..., H, n, N_k) float32 probabilities for the selected n query rows.
    """
    scores = attention_scores(q, k, attn_mask=attn_mask, scale=scale, is_causal=is_causal, queries=queries)
    return masked_softmax(scores, is_causal or attn_mask is not None)


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    """(..., H_kv, N, E) keys or values with each head repeated to ``heads`` heads (GQA)."""
    if t.shape[-3] == heads:
        return t
    if heads % t.shape[-3]:
        raise CaptureError(
            f"cannot recompute attention: {heads} query heads are not a multiple of {t.shape[-3]} key heads"
        )
    return t.repeat_interleave(heads // t.shape[-3], dim=-3)


def fuse_heads(x: Tensor, fusion: Fusion) -> Tensor:
    """Fuse the head dimension (dim 1) of a (B, H, n, N) tensor."""
    if fusion == "mean":
        return x.mean(dim=1)
    if fusion == "max":
        return x.amax(dim=1)
    if fusion == "min":
        return x.amin(dim=1)
    raise UsageError(f"unknown head fusion {fusion!r}; use 'mean', 'max' or 'min'")
