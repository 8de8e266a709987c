"""Windowed attention as dense matrices, without forming them: Swin's shifted windows and patch merging.

Block l of stage s attends inside windows of its stage grid (N_s = H_s * W_s tokens). Its
dense attention matrix ``A_l`` (N_s x N_s) is defined from the captured per-window
probabilities ``P_l`` (B * nW, H, n, n), n = wh * ww, by

    A_l[i, j] = P_l[w, a, b]   where token i sits in slot a and token j in slot b of window w,

and 0 when i and j share no window. The shift and padding decide the slots
(:meth:`~vitexplain.layout.WindowGeometry.index`); the shift mask and relative position
bias are already inside P_l. Padding slots are not tokens: their rows and columns are dropped.
Every token sits in exactly one window, so ``A_l`` is block-diagonal after the shift
permutation and ``r @ A_l`` costs O(N_s n) per image: gather r into windows, multiply each
window, scatter back.

Patch merging maps the 2 x 2 children c of merged token m (fewer at padded odd edges) to m.
Relevance is pushed from a merged token to its children with the distribution matrix
``D[m, c] = 1 / |children(m)|`` (row-stochastic): ``r_fine = r_coarse @ D``. It conserves
relevance (the children's total equals the parent's), so rollout rows stay distributions;
docs/methods.md derives the rule and compares it with a 0/1 gathering matrix.

Swin is one case of the general resampling rule (:mod:`.resample`): windows are the slots of
each call, the merge is a 2 x 2 footprint, and propagation is
:func:`~vitexplain.methods.resample.propagate` on :func:`swin_chain`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ..errors import CaptureError, OptionError, UnsupportedMethodError, UsageError
from ..layout import WindowGeometry
from ..recording import AttentionRecord
from ..recording.scores import fuse_heads
from .context import Context
from .resample import Call, CallSpec, Footprint, Item, TokenSet, Transition, propagate, readout

__all__ = ["WindowedLayer", "window_layers", "distribute", "merge_footprint", "swin_chain", "propagate_windows",
           "stage_vector"]


@dataclass
class WindowedLayer:
    """One block's captured windowed attention with its geometry.

    Attributes:
        index: block index (into ``adapter.blocks``).
        stage: stage of the block.
        geometry: the block's window geometry.
        record: its attention record ((B * nW, H, n, n) probabilities).
        batch: B.
        slots: (nW, n) long, the grid index of the token in each window slot, -1 for padding.
        pairs: (nW, n, n) bool, both slots hold tokens (the support of the dense matrix).
    """

    index: int
    stage: int
    geometry: WindowGeometry
    record: AttentionRecord
    batch: int
    slots: Tensor = field(init=False, repr=False)
    pairs: Tensor = field(init=False, repr=False)
    padded: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.slots = self.geometry.index(self.record.device)
        real = self.slots >= 0
        self.pairs = real[:, :, None] & real[:, None, :]
        self.padded = not bool(real.all())

    @property
    def num_tokens(self) -> int:
        return self.geometry.num_tokens

    def _per_window(self, x: Tensor) -> Tensor:
        """(B * nW, H, n, n) -> (B, nW, H, n, n) with padding rows and columns zeroed."""
        x = x.view(self.batch, self.geometry.num_windows, *x.shape[1:])
        if not self.padded:  # no padding slots: nothing to zero (no copy of A)
            return x
        return x * self.pairs[None, :, None].to(x.dtype)

    def probs(self) -> Tensor:
        """(B, nW, H, n, n) float32 attention probabilities per window (padding zeroed)."""
        return self._per_window(self.record.probs())

    def grad_probs(self, d_out: Optional[Tensor] = None) -> Tensor:
        """(B, nW, H, n, n) float32 dy/dA per window (padding zeroed)."""
        return self._per_window(self.record.grad_probs(d_out=d_out))

    def to_windows(self, r: Tensor) -> Tensor:
        """(B, N) per-token values -> (B, nW, n) per window slot (0 at padding)."""
        padded = torch.cat([r, r.new_zeros(r.shape[0], 1)], dim=1)
        idx = torch.where(self.slots < 0, self.num_tokens, self.slots)
        return padded[:, idx]

    def from_windows(self, v: Tensor) -> Tensor:
        """(B, nW, n) per-slot values -> (B, N) per token (padding slots dropped)."""
        real = self.slots >= 0
        out = v.new_zeros(v.shape[0], self.num_tokens)
        out[:, self.slots[real]] = v[:, real]
        return out

    def vec_mat(self, r: Tensor, m: Tensor) -> Tensor:
        """``r @ M_dense`` for per-window blocks m (B, nW, n, n): (B, N) -> (B, N)."""
        return self.from_windows(torch.einsum("bwq,bwqk->bwk", self.to_windows(r), m))

    def row_sums(self, m: Tensor) -> Tensor:
        """Row sums of ``M_dense`` over tokens: (B, nW, n, n) -> (B, N)."""
        return self.from_windows(m.sum(dim=-1))

    def fused(self, head_fusion: str = "mean", head: Optional[int] = None) -> Tensor:
        """(B, nW, n, n): one head's probabilities, or the heads fused (mean / max / min)."""
        if head is None and self.record.heads == head_fusion:  # the capture kept only this fusion
            fused = self.record.fused_probs(head_fusion)  # type: ignore[arg-type]
            fused = fused.view(self.batch, self.geometry.num_windows, *fused.shape[1:])
            return fused * self.pairs[None].to(fused.dtype) if self.padded else fused
        p = self.probs()
        if head is not None:
            return p[:, :, head]
        return fuse_heads(p.flatten(0, 1), head_fusion).view(p.shape[0], p.shape[1], *p.shape[3:])  # type: ignore[arg-type]


def window_layers(ctx: Context) -> list[WindowedLayer]:
    """The windowed attention of every block of a Swin model, input side first.

    One record per block (the last one the block issued in the captured forward), checked
    against the block's window geometry.

    Raises:
        UnsupportedMethodError: a block issued no attention call.
        CaptureError: a record's shape does not match the block's window geometry.
    """
    adapter = ctx.adapter
    grids = adapter.stage_grids(tuple(ctx.x.shape[-2:]))
    records = [r for r in ctx.recorder.records if r.kind == "self"]
    batch = ctx.batch_size
    layers = []
    for i, block in enumerate(adapter.swin_blocks):
        inside = [r for r in records if r.name == block.name or r.name.startswith(block.name + ".")]
        if not inside:
            raise UnsupportedMethodError(
                f"block {block.name!r} issued no attention call during the forward; method "
                f"{ctx.method!r} needs one per block"
            )
        record, geometry = inside[-1], adapter.geometry(i, grids[block.stage])
        expected = (batch * geometry.num_windows, geometry.window_area, geometry.window_area)
        if (record.batch_size, record.num_queries, record.num_keys) != expected:
            raise CaptureError(
                f"the attention of {block.name!r} has shape {tuple(record.q_shape[:3])} x "
                f"{record.num_keys} keys, but the block's window geometry (grid {geometry.grid}, "
                f"window {geometry.window}, shift {geometry.shift}) implies {expected[0]} windows of "
                f"{expected[1]} tokens; explain the model at the input size it was built for"
            )
        layers.append(WindowedLayer(i, block.stage, geometry, record, batch))
    return layers


def merge_footprint(fine: tuple[int, int], coarse: tuple[int, int]) -> Footprint:
    """Patch merging as a resampling footprint: merged token m covers its (up to) 2 x 2
    children, ``D[m, c] = 1 / |children(m)|`` (a 2 x 2 pooling, stride 2, no padding; odd
    edges have fewer children). A grid that did not merge maps onto itself.

    Made once per pair of grids (a footprint depends on nothing else and is never changed;
    its per-device copies are cached on it), not on every explained batch."""
    return _merge((int(fine[0]), int(fine[1])), (int(coarse[0]), int(coarse[1])))


@lru_cache(maxsize=64)
def _merge(fine: tuple[int, int], coarse: tuple[int, int]) -> Footprint:
    fine_set, coarse_set = TokenSet(0, fine), TokenSet(0, coarse)
    if fine == coarse:
        return Footprint.identity(fine_set)
    return Footprint.pool(fine_set, coarse_set, 2, 2, 0)


def distribute(r: Tensor, fine: tuple[int, int], coarse: tuple[int, int]) -> Tensor:
    """Push relevance of merged tokens to their children: ``r_fine = r_coarse @ D``
    (:func:`merge_footprint`).

    Args:
        r: (B, H_c * W_c) relevance over the coarse grid.
        fine: (H_f, W_f) grid of the children.
        coarse: (H_c, W_c) grid of the merged tokens.

    Returns:
        (B, H_f * W_f).
    """
    return merge_footprint(fine, coarse).pull(r)


Matrix = Callable[[WindowedLayer], Tensor]
"""Per-window blocks (B, nW, n, n) of a layer's dense matrix M_l."""


def swin_chain(layers: Sequence[WindowedLayer], grids: Sequence[tuple[int, int]]) -> list[Item]:
    """Swin as a chain of the resampling rule (:mod:`.resample`): each block one call whose
    query and key slots are its (shifted, padded) windows with identity footprints and an
    identity residual; between stages a merge (:func:`merge_footprint`)."""
    items: list[Item] = []
    stage = 0
    for layer in layers:
        while stage < layer.stage:
            items.append(Transition(merge_footprint(grids[stage], grids[stage + 1]), stage, stage + 1, "merge"))
            stage += 1
        tokens = TokenSet(0, grids[layer.stage])
        identity = merge_footprint(tokens.grid, tokens.grid)  # D = I on the stage grid (made once)
        spec = CallSpec(layer.record.name, tokens, tokens, layer.slots, layer.slots, identity, identity,
                        layer.stage, layer.stage)
        items.append(_SwinCall(spec, layer))
    while stage < len(grids) - 1:
        items.append(Transition(merge_footprint(grids[stage], grids[stage + 1]), stage, stage + 1, "merge"))
        stage += 1
    return items


class _SwinCall(Call):
    """A resampling call that remembers its :class:`WindowedLayer` (what Swin matrices read)."""

    def __init__(self, spec: CallSpec, layer: WindowedLayer) -> None:
        super().__init__(spec, layer.record, layer.batch, layer.index)
        self.layer = layer


def propagate_windows(
    layers: Sequence[WindowedLayer],
    grids: Sequence[tuple[int, int]],
    matrix: Matrix,
    *,
    mode: str,
    to_stage: int = 0,
    discard_ratio: float = 0.0,
    deviation: bool = False,
) -> Tensor:
    """Push the mean-pooling readout row through the layers, last first, down to a stage grid:
    :func:`vitexplain.methods.resample.propagate` on :func:`swin_chain`.

    The readout u is uniform over the last stage's tokens (the head averages them). Per block,
    ``mode="rollout"``: ``r <- r @ rownorm(0.5 M_l + 0.5 I)``; ``mode="generic"`` (Chefer):
    ``r <- r + r @ M_l``; between stages r is distributed to the children
    (:func:`distribute`). The row is carried as the identity path ``r0`` (u through the merges
    alone) plus the deviation ``d`` from it, so reading ``d`` alone loses no precision.

    Args:
        layers: all blocks' windowed attention, input side first.
        grids: (H_s, W_s) per stage.
        matrix: the per-window blocks of M_l for a layer.
        mode: ``"rollout"`` or ``"generic"``.
        to_stage: stage whose grid the result is on; layers of earlier stages are left out.
        discard_ratio: rollout's discard, over the entries that share a window.
        deviation: return ``u (R - R_identity)`` (``d``) instead of ``u R`` (``r0 + d``).

    Returns:
        (B, H_t * W_t) on the grid of ``to_stage``.
    """
    if mode not in ("rollout", "generic"):
        raise UsageError(f"unknown propagation mode {mode!r}; choose 'rollout' or 'generic'")
    last = len(grids) - 1
    if not -len(grids) <= to_stage <= last:
        raise OptionError(f"stage {to_stage} is out of range for a model with {len(grids)} stages")
    to_stage %= len(grids)
    items = swin_chain(layers, grids)
    start = readout(TokenSet(0, grids[last]), layers[-1].batch, layers[-1].record.device, "mean")
    return propagate(items, start, lambda call: matrix(call.layer), mode=mode, to_stage=to_stage,  # type: ignore[attr-defined]
                     discard_ratio=discard_ratio, deviation=deviation)


def stage_vector(grid: tuple[int, int], batch: int, device: torch.device, query: object = None) -> Tensor:
    """The query row(s) read on a stage grid: uniform (mean over all queries) or one token.

    Args:
        grid: (H_s, W_s).
        batch: B.
        device: device.
        query: None (mean over all query tokens), a flat index, or (row, col).

    Returns:
        (B, H_s * W_s).
    """
    n = grid[0] * grid[1]
    if query is None:
        return torch.full((batch, n), 1.0 / n, device=device)
    if isinstance(query, (tuple, list)) and len(query) == 2:
        row, col = (int(v) for v in query)
        if not (0 <= row < grid[0] and 0 <= col < grid[1]):
            raise OptionError(f"query {tuple(query)} is outside the stage grid {grid}")
        flat = row * grid[1] + col
    elif isinstance(query, int) and -n <= query < n:
        flat = query % n
    else:
        raise OptionError(f"query must be None, a token index in [-{n}, {n}) or (row, col) on the grid {grid}; got {query!r}")
    vector = torch.zeros(batch, n, device=device)
    vector[:, flat] = 1.0
    return vector
