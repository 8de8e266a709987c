"""Attention computed by the capture itself: ``P = softmax(q k^T * scale + mask)``, ``O = P V``.

In the default ``"fused"`` mode a capture lets ``F.scaled_dot_product_attention`` run its
fused kernel and methods recompute the probabilities they read from the recorded q and k.
A method that reads every layer's probabilities (rollout, gradient rollout, Chefer's
generic rule, LeGrad) then pays for attention twice. On a CPU it is cheaper to compute
attention once the eager way, keep P, and hand ``O = P V`` back to the model: one batched
matmul scaled by the GEMM (``baddbmm`` with ``alpha``), one softmax (into a second buffer of one
image's scores: torch's in-place softmax takes twice as long on CPU; in place only above
:data:`SOFTMAX_COPY_BYTES`), one matmul. The model's outputs equal the fused kernel's to float32
rounding (about 1e-6; the tests check 1e-5).

A float mask that is an additive bias (SAM's decomposed relative positions) is added by the
score GEMM itself (``baddbmm`` with the bias as its input), and when it holds no ``-inf`` the
softmax is a plain one as for an unmasked call. SDPA calls without a head dimension, (B, N, E)
(SAM folds its heads into the batch), are computed as one head. A materialized record does
not keep the call's mask (only that it had one): its probabilities already include it.

With gradients, P stays in the autograd graph and the record's tensor hook sits on P, so
the backward pass computes ``dy/dP`` itself (it needs it for the softmax backward anyway)
and ``grad_probs()`` returns it: no ``dO V^T`` product afterwards.

The modes (``vx.capture(model, attention_mode=...)``, ``vx.Explainer(model, attention_mode=...)``):

- ``"fused"``: never materialise (GPU memory, or only a few rows of one layer are read).
- ``"materialize"``: materialise every call that can be (float32 q, k, v, no dropout, no
  autocast, not inside a non-reentrant ``torch.utils.checkpoint`` with gradients on, whose backward
  recomputes the call as SDPA itself; others run the fused kernel and are recorded as usual). A capture nested in another
  one never materialises: the outer capture must see the call itself, not the inner capture's
  own scores and softmax (per image or per chunk).
- ``"auto"``: materialise on a CPU only, when no gradient is captured, while one call's
  probabilities take at most :data:`AUTO_CALL_BYTES` and all materialised probabilities of
  the capture stay within :data:`AUTO_TOTAL_BYTES`; the fused kernel otherwise (GPU runs keep
  the flash / memory-efficient kernels, and a 4,096-token image never stores N x N per
  layer). The Explainer passes ``"auto"`` only when a requested method reads every layer's
  probabilities, ``"fused"`` otherwise.

Why not with gradients: measured on a 2-core CPU (``benchmarks/methods.py``,
``vit_small_patch16_224``, batch 16), the eager backward through ``P V``, the softmax and
``q k^T`` costs more than the fused kernel's backward plus the ``dO V^T`` products and the
recompute: ``generic`` 1.14-1.26x a plain forward+backward materialised against 1.03-1.05x
fused, ``legrad`` 2.0x against 1.5x, ``grad_rollout`` about equal. Without gradients
materialising wins: ``rollout`` 1.04x a plain forward against 1.12x fused. ``"materialize"``
still forces it with gradients (then dy/dP comes from the backward pass itself).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..finite import all_finite
from ..errors import UsageError
from .scores import _repeat_heads, attention_scores, fuse_heads, masked_softmax, score_scale
from .workspace import Workspace

__all__ = [
    "MODES", "HEADS", "AUTO_CALL_BYTES", "AUTO_TOTAL_BYTES", "PER_IMAGE_MIN", "CHUNK_BYTES", "SOFTMAX_COPY_BYTES", "check_mode",
    "check_heads", "can_materialize",
    "attention_with_probs",
]

MODES = ("auto", "fused", "materialize")

#: What a materialized record may keep of its probabilities: every head, or their fusion.
HEADS = ("all", "mean", "max", "min")

#: ``"auto"`` materialises a call only when its probabilities (B x H x N_q x N_k float32)
#: take at most this many bytes (vit_small at 224 px, batch 32: 30 MB; 4,096 tokens: 400 MB).
AUTO_CALL_BYTES = 64 * 2**20

#: ...and while all probabilities it materialised in the capture (and their gradients) stay
#: within this many bytes; later calls then run the fused kernel.
AUTO_TOTAL_BYTES = 512 * 2**20


def check_mode(mode: Any) -> str:
    """``mode`` when it is one of :data:`MODES`.

    Raises:
        UsageError: any other value; the message lists the modes.
    """
    if mode not in MODES:
        raise UsageError(
            f"attention_mode must be one of {MODES} ('auto': compute attention once on CPU when it "
            f"is cheaper; 'fused': keep the fused kernel; 'materialize': always compute it), got {mode!r}"
        )
    return mode


def check_heads(heads: Any) -> str:
    """``heads`` when it is one of :data:`HEADS`.

    Raises:
        UsageError: any other value.
    """
    if heads not in HEADS:
        raise UsageError(f"heads must be one of {HEADS} (what materialized records keep), got {heads!r}")
    return heads


def can_materialize(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], dropout_p: float, enable_gqa: bool) -> bool:
    """Whether an SDPA call can be computed eagerly with the same result as the fused kernel.

    Args:
        q, k, v: (B, H, N_q, E), (B, H_kv, N_k, E), (B, H_kv, N_k, E_v) (extra leading dims
            already folded into B).
        mask: the call's ``attn_mask`` (None, bool or float32).
        dropout_p: the call's dropout probability (must be 0: dropout is random).
        enable_gqa: SDPA's grouped-query flag (fewer key/value heads).
    """
    tensors = (q, k, v)
    if any(t.dtype != torch.float32 or t.is_nested or t.dim() != 4 or t.numel() == 0 for t in tensors):
        return False  # (an empty call, e.g. no keys: the fused kernel's own zeros, nothing to keep)
    if dropout_p != 0.0 or _autocast(q.device.type):
        return False
    if mask is not None and mask.dtype not in (torch.bool, torch.float32):
        return False
    if k.shape[1] != q.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        return False  # let SDPA raise its own error
    return k.shape[:2] == v.shape[:2] and k.shape[-2] == v.shape[-2] and q.shape[0] == k.shape[0]


def _autocast(device_type: str) -> bool:
    """Whether autocast is on for this device type (devices without autocast: False)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def attention_with_probs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    is_causal: bool = False,
    heads: str = "all",
    workspace: Optional[Workspace] = None,
) -> tuple[Tensor, Tensor]:
    """SDPA computed eagerly, keeping the probabilities.

    Scores exactly as :func:`vitexplain.recording.scores.attention_scores` (masks, causal,
    scale, grouped-query heads); rows in which every key is masked give zero probabilities
    and a zero output, as the fused kernels do.

    Without gradients and without a mask, images are computed by chunks whose scores fit
    :data:`CHUNK_BYTES` (when one image's are large enough, :data:`PER_IMAGE_MIN`, or the
    batch's would not fit): one image at a time straight from the model's strided q, k, v (no
    copies), else several per GEMM; a chunk's scores stay in cache for the softmax and ``P V``,
    and O is written in q's memory order (what the fused kernel returns, so the model's
    ``transpose(1, 2).reshape(B, N, C)`` that follows is free). With ``heads`` a fusion, a
    chunk's (H, N_q, N_k) probabilities live in a scratch buffer and only their fusion is kept.

    Args:
        q: (B, H, N_q, E) float32 queries (see :func:`can_materialize`).
        k: (B, H_kv, N_k, E) keys.
        v: (B, H_kv, N_k, E_v) values.
        attn_mask: bool or float mask broadcastable to (B, H, N_q, N_k).
        scale: score scale; None means ``1 / sqrt(E)``.
        is_causal: SDPA's causal flag.
        heads: ``"all"`` or ``"mean"``/``"max"``/``"min"``: keep the probabilities of every
            head, or only their fusion (ignored when a gradient is taken: then P is part of
            the autograd graph and every head is kept).
        workspace: where the chunked path takes its probabilities and scratch from (buffers the
            model's earlier captures left free, :mod:`vitexplain.recording.workspace`); None: new ones.

    Returns:
        (O (B, H, N_q, E_v), P), both float32: P is (B, H, N_q, N_k), in the autograd graph
        when q or k requires grad, or (B, N_q, N_k) fused over heads.
    """
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if heads != "all" and q.shape[1] == 1 and not grad:  # the fusion of one head is that head: no pass over it
        out, probs = attention_with_probs(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal,
                                          workspace=workspace)
        return out, probs.squeeze(1)
    masked = is_causal or attn_mask is not None
    one = q.shape[1] * q.shape[2] * k.shape[2]  # scores of one image
    if not grad and not masked and (one >= PER_IMAGE_MIN or q.shape[0] * one * 4 > CHUNK_BYTES):
        return _per_image(q, k, v, score_scale(q, scale), heads, workspace)
    biased = (not grad and not is_causal and attn_mask is not None and attn_mask.dtype == torch.float32
              and k.shape[1] == q.shape[1])
    if biased:  # an additive bias (SAM's relative positions): added by the GEMM itself
        scores = _biased_scores(q, k, attn_mask, score_scale(q, scale))  # type: ignore[arg-type]
        if all_finite(attn_mask):  # no key masked out: a plain softmax
            probs = _softmax(scores)
        else:
            probs = masked_softmax(scores, True)
    else:
        scores = attention_scores(q, k, attn_mask=attn_mask, scale=scale, is_causal=is_causal)
        if not masked and not scores.requires_grad:
            probs = _softmax(scores)
        else:
            probs = masked_softmax(scores, masked)
    b, h, n_q, n_k = probs.shape
    values = _repeat_heads(v, h)
    out = torch.bmm(probs.view(b * h, n_q, n_k), values.reshape(b * h, n_k, values.shape[-1]))
    if heads != "all" and not grad:
        probs = fuse_heads(probs, heads)  # type: ignore[arg-type]
    out = out.view(b, h, n_q, -1)
    if _heads_inside_tokens(q):  # the fused kernel's layout, so the model's .view()s work alike
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
    return out, probs


def _biased_scores(q: Tensor, k: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``q k^T * scale + bias`` as one ``baddbmm`` (no separate pass adding the bias).

    Args:
        q: (B, H, N_q, E); k: (B, H, N_k, E) (as many heads as q).
        bias: float32, broadcastable to (B, H, N_q, N_k).

    Returns:
        (B, H, N_q, N_k) float32 scores.
    """
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    if bias.dim() <= 2:
        bias3 = bias  # broadcast by baddbmm itself
    else:
        bias3 = bias.expand(b, h, n_q, n_k).reshape(b * h, n_q, n_k)  # a view when B x H are kept
    q3, k3 = q.reshape(b * h, n_q, -1), k.reshape(b * h, n_k, -1)
    return torch.baddbmm(bias3, q3, k3.transpose(1, 2), alpha=scale).view(b, h, n_q, n_k)


def _heads_inside_tokens(q: Tensor) -> bool:
    """q is (B, N, H, E) in memory, viewed as (B, H, N, E) (timm's qkv): the fused kernel then
    returns its output in that layout too."""
    return q.stride(1) < q.stride(2)


#: Scores of up to this many bytes get their softmax in a new tensor; larger ones in place (no second
#: buffer that large). On CPU torch's in-place softmax (``out=`` the input) takes about twice as long
#: as one into another tensor (measured on the attention of timm's pvt_v2_b0, Swin and ViT-B: e.g.
#: 481 against 260 us on 2 x 3136 x 49 scores, one thread).
SOFTMAX_COPY_BYTES = 32 * 2**20


def _softmax(scores: Tensor) -> Tensor:
    """``softmax(scores, -1)``: a new tensor when ``scores`` take at most :data:`SOFTMAX_COPY_BYTES`, else in place."""
    if scores.numel() * scores.element_size() > SOFTMAX_COPY_BYTES:
        return torch.softmax(scores, dim=-1, out=scores)
    return torch.softmax(scores, dim=-1)


#: Computation by chunks of images (no copies of one image's q, k, v; scores in cache) when one image's
#: scores H x N_q x N_k have at least this many entries, or when the whole batch's scores would take more
#: than :data:`CHUNK_BYTES`; smaller calls (the zoo's 65-token ViT at a small batch) are batched, where the
#: per-chunk Python overhead would dominate.
PER_IMAGE_MIN = 2**16

#: The scores of a chunk of images take at most this many bytes (at least one image per chunk): they stay in
#: the CPU's cache for the softmax and ``P V``. Measured on a 2-core CPU, one thread (scores of 2 x 64 x 256
#: per image, batch 32, the zoo's shapes-hier stage 1): batched 8.8 ms, chunks 2.8 ms, the fused kernel 2.3 ms.
CHUNK_BYTES = 512 * 2**10


def _per_image(q: Tensor, k: Tensor, v: Tensor, scale: float, heads: str, workspace: Optional[Workspace] = None
               ) -> tuple[Tensor, Tensor]:
    """Unmasked attention without gradients, by chunks of images (see :func:`attention_with_probs`): one image
    at a time straight from the model's strided q, k, v when one image's scores fill a chunk, else
    ``CHUNK_BYTES // (one image's score bytes)`` images per GEMM."""
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    k, v = _repeat_heads(k, h), _repeat_heads(v, h)
    if _heads_inside_tokens(q):
        out = q.new_empty(b, n_q, h, v.shape[-1]).transpose(1, 2)
    else:
        out = q.new_empty(b, h, n_q, v.shape[-1])
    keep_all = heads == "all"

    def empty(*shape: int) -> Tensor:
        return q.new_empty(shape) if workspace is None else workspace.empty(shape, q)

    probs = empty(b, h, n_q, n_k) if keep_all else empty(b, n_q, n_k)
    one = h * n_q * n_k * q.element_size()  # bytes of one image's scores
    c = max(1, min(b, CHUNK_BYTES // one))  # images per chunk
    if c > 1:
        return _chunks(q, k, v, scale, heads, c, out, probs, empty)
    scratch = None if keep_all else empty(h, n_q, n_k)
    scores = empty(h, n_q, n_k) if one <= SOFTMAX_COPY_BYTES else None  # (else: softmax in place)
    mean_weights = q.new_full((1, h), 1.0 / h)  # the head mean as one GEMV pass over the scratch
    zero = q.new_zeros(())
    for i in range(b):
        p = probs[i] if scratch is None else scratch
        s = p if scores is None else scores
        torch.baddbmm(zero, q[i], k[i].transpose(1, 2), beta=0.0, alpha=scale, out=s)
        torch.softmax(s, dim=-1, out=p)
        torch.bmm(p, v[i], out=out[i])
        if heads == "mean":
            torch.mm(mean_weights, p.view(h, -1), out=probs[i].view(1, -1))
        elif heads != "all":
            (torch.amax if heads == "max" else torch.amin)(p, 0, out=probs[i])
    return out, probs


def _chunks(q: Tensor, k: Tensor, v: Tensor, scale: float, heads: str, c: int, out: Tensor, probs: Tensor,
            empty: Callable[..., Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`_per_image` for ``c`` > 1 images per chunk: each chunk's q, k, v as (c H, N, E) (a copy when the
    model's layout does not merge images and heads), one GEMM for its scores, one softmax, one ``P V``."""
    b, h, n_q, _ = q.shape
    n_k, e_v = k.shape[2], v.shape[-1]
    scores = empty(c * h, n_q, n_k)
    scratch = None if heads == "all" else empty(c * h, n_q, n_k)
    direct = out.is_contiguous()  # (B, H, N_q, E_v): P V goes straight into it, a chunk at a time
    values = None if direct else empty(c * h, n_q, e_v)
    zero = q.new_zeros(())
    for start in range(0, b, c):
        n = min(c, b - start)
        part = slice(start, start + n)
        rows = n * h
        s = scores[:rows]
        torch.baddbmm(zero, q[part].reshape(rows, n_q, -1), k[part].reshape(rows, n_k, -1).transpose(1, 2),
                      beta=0.0, alpha=scale, out=s)
        p = probs[part].view(rows, n_q, n_k) if scratch is None else scratch[:rows]
        torch.softmax(s, dim=-1, out=p)
        if values is None:
            torch.bmm(p, v[part].reshape(rows, n_k, e_v), out=out[part].view(rows, n_q, e_v))
        else:  # (the model's layout keeps heads inside tokens: a copy into it)
            torch.bmm(p, v[part].reshape(rows, n_k, e_v), out=values[:rows])
            out[part] = values[:rows].view(n, h, n_q, e_v)
        if heads == "mean":
            torch.mean(p.view(n, h, -1), dim=1, out=probs[part].view(n, -1))
        elif heads != "all":
            (torch.amax if heads == "max" else torch.amin)(p.view(n, h, n_q, n_k), 1, out=probs[part])
    return out, probs
