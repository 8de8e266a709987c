"""Attention and relevance through token resampling: one rule for hierarchical transformers.

A hierarchical vision transformer moves its tokens between *token sets*: ``prefix`` tokens
(class, distillation) followed by a row-major grid (H_s, W_s). Two things change sets:

- an **attention call** maps a query set onto a key set. Its queries are the tokens of the
  block's output set Q, grouped in G windows of n_q slots (G = 1 for global attention;
  windows, shifted windows, dilated grids and padding are only a choice of slots); its keys
  are n_k slots per window over a key set K made from the block's input set I by a
  resampling (identity for ordinary attention; a strided conv or pooling for the pooled keys
  and values of PVT, Twins' GSA, SegFormer and MViTv2). The residual path of the block maps
  Q onto I through its own resampling (identity; MViTv2's pooled skip; none for LeViT's
  attention-subsample block).
- a **transition** between blocks maps one set onto another (patch merging, a strided conv or
  pooling, a conv neck on the same grid).

Each resampling is read through its *footprint*: the linear map from the coarse token set to
the fine one, ``D[m, c] = 1 / |F(m)|`` for the fine tokens c in the receptive field F(m) of
coarse token m that are real (not padding), prefix tokens mapping onto themselves. D is
row-stochastic, so relevance is conserved: ``r_fine = r_coarse @ D``.

The dense matrix of an attention call from its output set to its input set is

    M = S_q^T A S_k D_k            (n_Q x n_I),

with A the per-window probabilities, S_q / S_k the slot placements and D_k the keys'
footprint, and the residual path is D_q (n_Q x n_I). Rollout multiplies
``rownorm(0.5 M + 0.5 D_q)`` (``rownorm(M)`` without a residual); Chefer's rule adds
``r @ M_bar`` to ``r @ D_q``; transitions multiply by their footprint. For ViTs
(D = I, G = 1) this is the usual rule; for Swin (windows, shift, 2 x 2 merges) it is the rule
of :mod:`.windowed`. Nothing dense is ever formed: ``r @ M`` gathers r into windows, multiplies
each window, scatters onto the key set and pulls through D_k: O(B N_k K) per call.
docs/methods.md ("Hierarchical transformers") states the rule, its sources and its assumptions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from ..errors import CaptureError, OptionError, UnsupportedMethodError, UsageError
from ..recording import AttentionRecord
from ..recording.scores import fuse_heads
from .footprint import Footprint, TokenSet, full_slots, grid_slots, window_slots

__all__ = ["TokenSet", "Footprint", "CallSpec", "Transition", "Call", "bind", "propagate", "readout",
           "window_slots", "grid_slots", "full_slots"]


# -- the chain --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CallSpec:
    """One attention call of a hierarchical model, as its adapter describes it (no record yet).

    Attributes:
        name: the attention module that issues the call (its last call in the forward is read).
        inp: the block's input token set I.
        out: the block's output (query) set Q.
        q_slots: (G, n_q) indices into Q of each window's query slots (-1 = padding).
        k_slots: (G, n_k) indices into the key set of each window's key slots (-1 = padding).
        keys: the footprint from the key set onto I (the values' resampling).
        skip: the residual path's footprint from Q onto I, or None (no residual).
        in_stage: stage of I; out_stage: stage of Q.
        folded_heads: heads folded into the call's batch dimension (SAM calls SDPA on
            (B * G * heads, n, d)); 1 when the record has a head dimension of its own.
        window_dim_inside: the model's SDPA call is (B, heads, G, n, d) (Hiera's mask units),
            recorded as (B * heads, G, n, n): windows where a record keeps heads.
    """

    name: str
    inp: TokenSet
    out: TokenSet
    q_slots: Tensor = field(repr=False)
    k_slots: Tensor = field(repr=False)
    keys: Footprint = field(repr=False)
    skip: Optional[Footprint] = field(repr=False)
    in_stage: int = 0
    out_stage: int = 0
    folded_heads: int = 1
    window_dim_inside: bool = False

    @property
    def windows(self) -> int:
        return int(self.q_slots.shape[0])


@dataclass(frozen=True)
class Transition:
    """A resampling between blocks (patch merging, a strided conv, a conv neck).

    Attributes:
        footprint: from the later (coarse) set onto the earlier (fine) set.
        in_stage: stage of the fine set; out_stage: stage of the coarse set.
        name: what it is (for messages).
    """

    footprint: Footprint
    in_stage: int
    out_stage: int
    name: str = ""


class Call:
    """A :class:`CallSpec` bound to its attention record of one batch of B images."""

    def __init__(self, spec: CallSpec, record: AttentionRecord, batch: int, index: int) -> None:
        self.spec, self.record, self.batch, self.index = spec, record, batch, index
        (self.q_slots, self.k_slots, self.pairs, self.padded, self.q_whole, self.k_whole,
         self.q_once, self.q_inverse, self.k_inverse) = _geometry(spec, record.device)

    @property
    def num_heads(self) -> int:
        """The call's attention heads: those folded into its batch (SAM), those recorded where a record keeps
        its batch (Hiera's windows sit where heads are), or the record's own."""
        if self.spec.folded_heads > 1:
            return self.spec.folded_heads
        if self.spec.window_dim_inside:
            return self.record.batch_size // self.batch
        return self.record.num_heads

    @property
    def in_stage(self) -> int:
        return self.spec.in_stage

    @property
    def out_stage(self) -> int:
        return self.spec.out_stage

    @property
    def rows_sum_to_one(self) -> bool:
        """Every row of M over the output set sums to 1: each output token is a query exactly
        once (not so for a call whose queries are only some tokens, as CrossViT's class token),
        no padding slot is zeroed, and the probability rows sum to 1 (an SDPA call without
        mask, see ``AttentionRecord.rows_sum_to_one``)."""
        return self.q_once and not self.padded and bool(self.record.rows_sum_to_one)

    def _per_window(self, x: Tensor, mask: bool = True) -> Tensor:
        """(B * G, H, n_q, n_k) -> (B, G, H, n_q, n_k), padding rows and columns zeroed (unless
        ``mask`` is False)."""
        heads = self.spec.folded_heads
        if heads > 1 or x.dim() == 3:  # (B * G * heads, [1,] n_q, n_k) -> (B * G, heads, n_q, n_k); a 3-D record
            x = x.reshape(-1, heads, *x.shape[-2:])  # (SDPA on (B * G, n, d): SAM with one head) gets its head dim
        if self.spec.window_dim_inside:  # (B * heads, G, n_q, n_k) -> (B, G, heads, n_q, n_k)
            x = x.reshape(self.batch, -1, *x.shape[1:]).transpose(1, 2)
        else:
            x = x.reshape(self.batch, self.spec.windows, *x.shape[1:])
        if not mask or not self.padded:  # no padding slots: nothing to zero (no copy of A)
            return x
        return x * self.pairs[None, :, None].to(x.dtype)

    def probs(self) -> Tensor:
        """(B, G, H, n_q, n_k) float32 probabilities per window."""
        return self._per_window(self.record.probs())

    def grad_probs(self, d_out: Optional[Tensor] = None) -> Tensor:
        """(B, G, H, n_q, n_k) float32 dy/dA per window."""
        return self._per_window(self.record.grad_probs(d_out=d_out))

    def fused(self, head_fusion: str = "mean", head: Optional[int] = None) -> Tensor:
        """(B, G, n_q, n_k): one head, or the heads fused."""
        p = self._per_window(self.record.probs(), mask=False)
        if head is not None:
            p = p[:, :, head]
        elif p.shape[2] == 1:  # one head: its mean, max and min are itself (a view, no pass over A)
            p = p[:, :, 0]
        else:
            p = fuse_heads(p.flatten(0, 1), head_fusion).view(p.shape[0], p.shape[1], *p.shape[3:])  # type: ignore[arg-type]
        # padding is zeroed after fusing (a padded pair is 0 in every head, so the fusion is 0
        # either way): the mask multiplies one (B, G, n_q, n_k) block, not every head
        return p * self.pairs[None].to(p.dtype) if self.padded else p

    def _gather(self, r: Tensor, slots: Tensor, whole: bool = False) -> Tensor:
        """(B, n) per token -> (B, G, n_slots) per slot (0 at padding); a view when the call
        is ``whole`` (one window holding every token in order)."""
        if whole:
            return r.unsqueeze(1)
        if not self.padded:  # (index_select: a fraction of advanced indexing's time at batch 32)
            return r.index_select(1, slots.flatten()).view(r.shape[0], *slots.shape)
        padded = torch.cat([r, r.new_zeros(r.shape[0], 1)], dim=1)
        return padded[:, torch.where(slots < 0, r.shape[1], slots)]

    def _scatter(self, v: Tensor, slots: Tensor, n: int, whole: bool = False,
                 inverse: Optional[Tensor] = None) -> Tensor:
        """(B, G, n_slots) per slot -> (B, n) per token, summed over the slots of a token
        (a view of v when the call is ``whole``; one gather through ``inverse`` when the slots
        hold each token exactly once: a sum of one value is that value)."""
        if whole:
            return v.reshape(v.shape[0], n)
        if inverse is not None:
            return v.reshape(v.shape[0], -1).index_select(1, inverse)
        out = v.new_zeros(v.shape[0], n)
        if not self.padded:
            return out.index_add_(1, slots.flatten(), v.flatten(1))
        real = slots >= 0
        return out.index_add_(1, slots[real], v[:, real])

    def on_keys(self, r: Tensor, m: Tensor) -> Tensor:
        """``r @ S_q^T m S_k`` on the key set (before the keys' footprint): (B, n_K)."""
        rows = self._gather(r, self.q_slots, self.q_whole).unsqueeze(-2)  # (B, G, 1, n_q)
        return self._on_key_set(torch.matmul(rows, m))

    def _on_key_set(self, per_key: Tensor) -> Tensor:
        """(B, G, 1, n_k) per key slot -> (B, n_K) on the key set."""
        return self._scatter(per_key.squeeze(-2), self.k_slots, self.spec.keys.coarse.n, self.k_whole, self.k_inverse)

    def vec_mat(self, r: Tensor, m: Tensor) -> Tensor:
        """``r @ M`` with M = S_q^T m S_k D_k: (B, n_Q) -> (B, n_I) for blocks m (B, G, n_q, n_k)."""
        return self.spec.keys.pull(self.on_keys(r, m))

    def vec_mat_head_mean(self, r: Tensor) -> Tensor:
        """``r @ M`` for M the head mean of this call's probabilities (:meth:`fused` ``"mean"``), without forming
        the mean: each head's product with its block, averaged over the heads. One pass over every head's A,
        where forming the mean reads them, writes the fused blocks, and the product reads those again (the
        zoo's shapes-hier at batch 32: the rollout method's 1.4 ms were mostly that mean). In the record's own
        layout (Hiera keeps windows where heads are): no copy of A. Padded calls take :meth:`vec_mat` of the
        fused blocks (their padding is zeroed there)."""
        if self.padded:
            return self.vec_mat(r, self.fused("mean"))
        p = self.record.probs()
        heads = self.spec.folded_heads
        if heads > 1 or p.dim() == 3:  # (B * G * heads, [1,] n_q, n_k) -> (B * G, heads, n_q, n_k)
            p = p.reshape(-1, heads, *p.shape[-2:])
        batch = r.shape[0]
        rows = self._gather(r, self.q_slots, self.q_whole)  # (B, G, n_q)
        if self.spec.window_dim_inside:  # (B * heads, G, n_q, n_k) -> (B, heads, G, n_q, n_k)
            p = p.reshape(batch, -1, *p.shape[1:])
            per_key = _mean_over(torch.matmul(rows[:, None, :, None, :], p), 1)  # (B, G, 1, n_k)
        else:  # (B * G, heads, n_q, n_k) -> (B, G, heads, n_q, n_k)
            p = p.reshape(batch, self.spec.windows, *p.shape[1:])
            per_key = _mean_over(torch.matmul(rows[:, :, None, None, :], p), 2)  # (B, G, 1, n_k)
        return self.spec.keys.pull(self._on_key_set(per_key))

    def row_sums(self, m: Tensor) -> Tensor:
        """Row sums of M over the output set: (B, G, n_q, n_k) -> (B, n_Q)."""
        return self._scatter(m.sum(dim=-1), self.q_slots, self.spec.out.n, self.q_whole, self.q_inverse)

    def skip(self, r: Tensor) -> Tensor:
        """``r @ D_q`` (the residual path), or zeros on I without a residual."""
        if self.spec.skip is None:
            return r.new_zeros(r.shape[0], self.spec.inp.n)
        return self.spec.skip.pull(r)


Item = Union[Call, Transition]


def _mean_over(x: Tensor, dim: int) -> Tensor:
    """The mean over the heads at ``dim``; one head: a view of it (its mean is itself, bit for bit)."""
    return x.squeeze(dim) if x.shape[dim] == 1 else x.mean(dim=dim)


def _inverse(slots: Tensor, n: int) -> Optional[Tensor]:
    """When ``slots`` (no padding) hold each of the set's n tokens exactly once: per token, the flat index of its
    slot (scattering per slot values is then one gather); else None."""
    flat = slots.flatten()
    if flat.numel() != n or not _once(slots, n):
        return None
    return torch.argsort(flat)


def _whole(slots: Tensor, n: int) -> bool:
    """Whether ``slots`` is one window holding each of the set's n tokens in order."""
    return tuple(slots.shape) == (1, n) and bool((slots[0] == torch.arange(n)).all())


def _once(slots: Tensor, n: int) -> bool:
    """Whether each of the set's n tokens sits in exactly one slot."""
    counts = torch.bincount(slots[slots >= 0], minlength=n)
    return counts.numel() == n and bool((counts == 1).all())


def _geometry(spec: CallSpec, device: torch.device
              ) -> tuple[Tensor, Tensor, Tensor, bool, bool, bool, bool, Optional[Tensor], Optional[Tensor]]:
    """A call's slots on ``device``, its real (query, key) pairs (G, n_q, n_k), whether any
    slot is padding, whether its queries / keys are whole sets in order (global attention:
    gathering and scattering are then views), whether every output token is a query
    exactly once, and the inverse of the query / key slots where they are a permutation of
    their set (:func:`_inverse`, on ``device``); built once per spec and device (the adapter
    caches its chain per input size)."""
    cache = spec.__dict__.setdefault("_on_device", {})
    if device not in cache:
        q_slots, k_slots = spec.q_slots.to(device), spec.k_slots.to(device)
        pairs = (q_slots >= 0)[:, :, None] & (k_slots >= 0)[:, None, :]
        q_inverse, k_inverse = _inverse(spec.q_slots, spec.out.n), _inverse(spec.k_slots, spec.keys.coarse.n)
        cache[device] = (q_slots, k_slots, pairs, bool((q_slots < 0).any() or (k_slots < 0).any()),
                         _whole(spec.q_slots, spec.out.n), _whole(spec.k_slots, spec.keys.coarse.n),
                         _once(spec.q_slots, spec.out.n),
                         None if q_inverse is None else q_inverse.to(device),
                         None if k_inverse is None else k_inverse.to(device))
    return cache[device]


def bind(chain: Sequence[Union[CallSpec, Transition]], records: Sequence[AttentionRecord], batch: int,
         method: str) -> list[Item]:
    """Attach to each call of ``chain`` the last attention record its module issued.

    Raises:
        UnsupportedMethodError: a module issued no attention call.
        CaptureError: a record's shape is not the one its spec implies (input size, windows).
    """
    selfs = [r for r in records if r.kind == "self"]
    items: list[Item] = []
    count = 0
    for spec in chain:
        if isinstance(spec, Transition):
            items.append(spec)
            continue
        inside = [r for r in selfs if r.name == spec.name or r.name.startswith(spec.name + ".")]
        if not inside:
            raise UnsupportedMethodError(
                f"{spec.name!r} issued no attention call during the forward; method {method!r} needs one per block")
        record = inside[-1]
        want = (batch * spec.windows * spec.folded_heads, spec.q_slots.shape[1], spec.k_slots.shape[1])
        got = (record.batch_size, record.num_queries, record.num_keys)
        if spec.window_dim_inside:  # windows recorded where heads are
            want = (spec.windows, *want[1:])
            got = (record.num_heads if record.batch_size % batch == 0 else -1, *got[1:])
        if got != want:
            raise CaptureError(
                f"the attention of {spec.name!r} is {got[0]} x {got[1]} queries x {got[2]} keys, but the model's "
                f"geometry (input set {spec.inp}, output set {spec.out}) implies {want}; explain the model at "
                "the input size it was built for")
        items.append(Call(spec, record, batch, count))
        count += 1
    return items


def calls(items: Sequence[Item]) -> list[Call]:
    """The attention calls of a bound chain, input side first."""
    return [i for i in items if isinstance(i, Call)]


def discard(m: Tensor, pairs: Tensor, ratio: float) -> Tensor:
    """Rollout's discard: zero the smallest ``ratio`` of each image's entries among the real
    (query, key) pairs. m: (B, G, n_q, n_k); pairs: (G, n_q, n_k) bool."""
    if not 0.0 <= ratio < 1.0:
        raise OptionError(f"discard_ratio must be in [0, 1), got {ratio}")
    count = int(int(pairs.sum()) * ratio)
    if count == 0:
        return m
    flat = m.flatten(1).clone()
    ranked = flat.masked_fill(~pairs.flatten()[None], float("inf"))
    _, indices = ranked.topk(count, dim=1, largest=False)
    return flat.scatter_(1, indices, 0.0).view_as(m)


Matrix = Callable[[Call], Tensor]
"""Per-window blocks (B, G, n_q, n_k) of a call's matrix."""


def readout(tokens: TokenSet, batch: int, device: torch.device, kind: str = "mean") -> Tensor:
    """The row the head reads on the last set: the class token (``"class"``), the mean over the
    prefix tokens (``"prefix"``: class and distillation heads averaged) or the mean over the
    grid tokens (``"mean"``): (B, n)."""
    vector = torch.zeros(batch, tokens.n, device=device)
    if kind == "class" and tokens.prefix:
        vector[:, 0] = 1.0
    elif kind == "prefix" and tokens.prefix:  # the mean of the heads on every prefix token (distilled)
        vector[:, :tokens.prefix] = 1.0 / tokens.prefix
    else:
        vector[:, tokens.prefix:] = 1.0 / (tokens.n - tokens.prefix)
    return vector


def propagate(items: Sequence[Item], start: Tensor, matrix: Matrix, *, mode: str, to_stage: int,
              discard_ratio: float = 0.0, deviation: bool = False, stochastic: bool = False,
              head_mean: bool = False) -> Tensor:
    """Carry a readout row from the last token set back to the set of ``to_stage``.

    Walking the chain last item first, an item is applied when its input stage is at least
    ``to_stage`` (so the result is on the first set of that stage). Per call, ``mode="rollout"``:
    ``r <- r @ rownorm(0.5 M + 0.5 D_q)`` (``rownorm(M)`` without a residual); ``"generic"``
    (Chefer): ``r <- r @ D_q + r @ M``; transitions: ``r <- r @ D``. The row is carried as the
    residual path's part ``r0`` (the readout through skips and transitions alone) plus the
    deviation ``d``, so reading ``d`` alone (``deviation=True``, ``u (R - R_identity)``) loses
    no precision.

    Args:
        items: the bound chain, input side first.
        start: (B, n_last) the readout row.
        matrix: the blocks of M per call (fused attention, or gradient-weighted).
        mode: ``"rollout"`` or ``"generic"``.
        to_stage: stage whose first set the result is on.
        discard_ratio: rollout's discard, over each call's real (query, key) pairs.
        deviation: return ``d`` instead of ``r0 + d``.
        stochastic: ``matrix`` keeps row sums (one head, or the head mean): a call whose
            probability rows sum to 1 (:attr:`Call.rows_sum_to_one`) gives M rows summing to 1,
            so rollout does not compute them (as the ViT rollout, to float rounding).
        head_mean: with ``stochastic``, ``matrix`` is the head mean of each call's probabilities:
            rollout (without discard) multiplies the row with every head's block and averages
            (:meth:`Call.vec_mat_head_mean`) instead of forming the mean.

    Returns:
        (B, n) over the token set of ``to_stage``.
    """
    if mode not in ("rollout", "generic"):
        raise UsageError(f"unknown propagation mode {mode!r}; choose 'rollout' or 'generic'")
    if mode == "rollout" and not deviation:
        return _rollout_row(items, start, matrix, to_stage, discard_ratio, stochastic, head_mean)
    r0, d = start, torch.zeros_like(start)
    for item in reversed(items):
        if item.in_stage < to_stage:
            break
        if isinstance(item, Transition):
            r0, d = item.footprint.pull(r0), item.footprint.pull(d)
            continue
        m = matrix(item)
        if mode == "generic":
            d = item.skip(d) + item.vec_mat(r0 + d, m)
            r0 = item.skip(r0)
            continue
        if discard_ratio > 0:
            m = discard(m, item.pairs, discard_ratio)
        sums = item.row_sums(m)
        if item.spec.skip is None:
            d = item.vec_mat((r0 + d) / sums.clamp(min=1e-30), m)
            r0 = torch.zeros_like(d)
            continue
        w = (r0 + d) / (0.5 * sums + 0.5)
        d = 0.5 * item.vec_mat(w, m) + item.skip(d - 0.5 * w * sums)
        r0 = item.skip(r0)
    return d if deviation else r0 + d


def _rollout_row(items: Sequence[Item], start: Tensor, matrix: Matrix, to_stage: int, discard_ratio: float,
                 stochastic: bool, head_mean: bool = False) -> Tensor:
    """``u R`` of :func:`propagate`'s rollout carried as one row (when the deviation is not
    read, nothing is lost: every term is non-negative). The split form's update sums to
    ``r0 + d = 0.5 (w @ M + w @ D_q)`` with ``w = r / (0.5 s + 0.5)`` (``r0 + d - 0.5 w s =
    0.5 w``), which is ``w' @ M + w' @ D_q`` with ``w' = r / (s + 1)`` bit for bit (scaling by
    2 is exact): a third of the vector operations per call."""
    r = start
    for item in reversed(items):
        if item.in_stage < to_stage:
            break
        if isinstance(item, Transition):
            r = item.footprint.pull(r)
            continue
        if stochastic and not discard_ratio > 0 and item.rows_sum_to_one:  # row sums 1: w = r / 2 (no pass over m)
            if head_mean:  # every head's product, averaged (no mean formed)
                times = item.vec_mat_head_mean
            else:
                m = matrix(item)
                times = lambda w: item.vec_mat(w, m)  # noqa: E731 (bound to this item's m)
            if item.spec.skip is None:
                r = times(r)
            else:
                w = 0.5 * r
                r = times(w) + item.skip(w)
            continue
        m = matrix(item)
        if discard_ratio > 0:
            m = discard(m, item.pairs, discard_ratio)
        sums = item.row_sums(m)
        if item.spec.skip is None:
            r = item.vec_mat(r / sums.clamp(min=1e-30), m)
            continue
        w = r / (sums + 1.0)
        r = item.vec_mat(w, m) + item.skip(w)
    return r


def stage_count(items: Sequence[Item]) -> int:
    """Number of stages a chain spans."""
    return max(max(i.in_stage, i.out_stage) for i in items) + 1
