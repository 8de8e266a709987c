"""Token sets, resampling footprints and window slots: the geometry of :mod:`.resample`.

A token set is ``prefix`` tokens followed by a row-major grid. A footprint is the
row-stochastic map from a coarse set to the fine set it was made from (a conv, a pooling, an
adaptive pooling, patch merging), ``D[m, c] = 1 / |F(m)|`` over the real fine tokens c in the
receptive field F(m); slots say which token of a set sits in each window position of an
attention call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..errors import UnsupportedMethodError, UsageError

__all__ = ["TokenSet", "Footprint", "full_slots", "window_slots", "grid_slots"]


@dataclass(frozen=True)
class TokenSet:
    """``prefix`` tokens followed by a row-major grid.

    Attributes:
        prefix: number of prefix tokens (class, distillation) before the grid.
        grid: (H, W).
    """

    prefix: int
    grid: tuple[int, int]

    @property
    def n(self) -> int:
        """prefix + H * W."""
        return self.prefix + self.grid[0] * self.grid[1]

    def on_grid(self, r: Tensor) -> Tensor:
        """(B, n) values over the set -> (B, H, W) over its grid (prefix dropped)."""
        return r[:, self.prefix:].reshape(r.shape[0], *self.grid)


#: :meth:`Footprint.pull` multiplies by D as a dense matrix when it has at most this many
#: entries (1 MiB in float32): measured on one CPU thread, a 49 x 3,136 D (PVTv2's pooled keys
#: at 224 px) takes 14 us dense against 29 us through its entries, a 784 x 3,136 one 207 us
#: against 55 us.
DENSE_PULL_ENTRIES = 2**18


def _axis(fine: int, coarse: int, kernel: int, stride: int, padding: int) -> list[list[int]]:
    """Per coarse index, the fine indices of its receptive field that are real."""
    return [[c for c in range(o * stride - padding, o * stride - padding + kernel) if 0 <= c < fine]
            for o in range(coarse)]


def _adaptive_axis(fine: int, coarse: int) -> list[list[int]]:
    """Per coarse index, its bin of ``adaptive_avg_pool`` (PyTorch's start/end rule)."""
    return [list(range((o * fine) // coarse, -(-((o + 1) * fine) // coarse))) for o in range(coarse)]


@dataclass(frozen=True)
class Footprint:
    """A row-stochastic footprint D (coarse set x fine set), stored sparsely.

    Attributes:
        coarse: the coarse token set (rows).
        fine: the fine token set (columns).
        index: (n_coarse, K) long, the fine tokens of each coarse token (-1 = none).
        weight: (n_coarse, K) float64, their weights (each row sums to 1 where it has tokens).
    """

    coarse: TokenSet
    fine: TokenSet
    index: Tensor = field(repr=False)
    weight: Tensor = field(repr=False)

    @classmethod
    def identity(cls, tokens: TokenSet) -> "Footprint":
        """D = I on one set."""
        return cls(tokens, tokens, torch.arange(tokens.n)[:, None], torch.ones(tokens.n, 1, dtype=torch.float64))

    @classmethod
    def _from_axes(cls, fine: TokenSet, coarse: TokenSet, rows: list[list[int]], cols: list[list[int]]) -> "Footprint":
        """The footprint whose coarse token (i, j) covers the fine cells ``rows[i] x cols[j]``
        (row-major, real cells first in each row), built with tensor ops: no Python loop over
        the coarse grid (Swin's 56 x 56 -> 28 x 28 merge took 6.7 ms that way)."""
        if coarse.prefix not in (fine.prefix, 0) and fine.prefix != 0:
            raise UsageError(f"a resampling from {fine} to {coarse} must keep, drop or add the prefix tokens")
        r_axis, c_axis = _padded(rows), _padded(cols)  # (H_c, k_h), (W_c, k_w); -1 = none
        cells = (r_axis[:, None, :, None] * fine.grid[1] + c_axis[None, :, None, :]).flatten(2).flatten(0, 1)
        real = ((r_axis >= 0)[:, None, :, None] & (c_axis >= 0)[None, :, None, :]).flatten(2).flatten(0, 1)
        order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # real cells first, in order
        cells, real = cells.gather(1, order), real.gather(1, order)
        count = real.sum(dim=1, keepdim=True)
        grid_index = torch.where(real, cells + fine.prefix, torch.full_like(cells, -1))
        grid_weight = torch.where(real, 1.0 / count.clamp(min=1).to(torch.float64), torch.zeros((), dtype=torch.float64))
        index = torch.full((coarse.n, grid_index.shape[1]), -1, dtype=torch.long)
        weight = torch.zeros(coarse.n, grid_index.shape[1], dtype=torch.float64)
        index[coarse.prefix:], weight[coarse.prefix:] = grid_index, grid_weight
        if fine.prefix:  # kept prefix tokens map onto themselves; added ones (a class token joined by the
            prefix = torch.arange(coarse.prefix)  # embedding, PVT's last stage) carry nothing of the fine set
            index[prefix, 0], weight[prefix, 0] = prefix, 1.0
        return cls(coarse, fine, index, weight)

    @classmethod
    def pool(cls, fine: TokenSet, coarse: TokenSet, kernel: Union[int, Sequence[int]], stride: Union[int, Sequence[int]],
             padding: Union[int, Sequence[int]] = 0) -> "Footprint":
        """The footprint of a convolution or pooling with this kernel, stride and padding.

        Coarse token (i, j) covers the fine rows ``i * s - p ... i * s - p + k - 1`` (and
        columns likewise) that exist; prefix tokens map onto themselves (or are dropped when
        the coarse set has none).
        """
        (kh, kw), (sh, sw), (ph, pw) = (_two(v) for v in (kernel, stride, padding))
        return cls._from_axes(fine, coarse, _axis(fine.grid[0], coarse.grid[0], kh, sh, ph),
                              _axis(fine.grid[1], coarse.grid[1], kw, sw, pw))

    @classmethod
    def adaptive(cls, fine: TokenSet, coarse: TokenSet) -> "Footprint":
        """The footprint of ``adaptive_avg_pool2d`` from the fine grid to the coarse grid."""
        return cls._from_axes(fine, coarse, _adaptive_axis(fine.grid[0], coarse.grid[0]),
                              _adaptive_axis(fine.grid[1], coarse.grid[1]))

    @cached_property
    def is_identity(self) -> bool:
        """D = I (checked once per footprint: the adapter caches its chain per input size)."""
        return self.coarse == self.fine and self.index.shape[1] == 1 and bool(
            (self.index[:, 0] == torch.arange(self.fine.n)).all())

    @cached_property
    def _entries(self) -> tuple[Tensor, Tensor, Tensor]:
        """The nonzero entries of D once: (rows, columns, weights) of its real (index, weight) pairs."""
        real = self.index >= 0
        rows = torch.arange(self.coarse.n)[:, None].expand_as(self.index)
        return rows[real], self.index[real], self.weight[real]

    def _on(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """:attr:`_entries` on ``device`` with weights in ``dtype``, converted once per (device, dtype)."""
        cache = self.__dict__.setdefault("_entries_on", {})
        key = (device, dtype)
        if key not in cache:
            rows, cols, weights = self._entries
            cache[key] = (rows.to(device), cols.to(device), weights.to(device=device, dtype=dtype))
        return cache[key]

    def _dense_on(self, device: torch.device, dtype: torch.dtype) -> Optional[Tensor]:
        """D as a dense (n_coarse, n_fine) matrix on ``device`` in ``dtype`` when it is small
        (at most :data:`DENSE_PULL_ENTRIES` entries), made once per (device, dtype); else None."""
        if self.coarse.n * self.fine.n > DENSE_PULL_ENTRIES:
            return None
        cache = self.__dict__.setdefault("_dense_cache", {})
        key = (device, dtype)
        if key not in cache:
            cache[key] = self.dense().to(device=device, dtype=dtype)
        return cache[key]

    def pull(self, r: Tensor) -> Tensor:
        """``r @ D``: (B, n_coarse) -> (B, n_fine). A small D is one GEMM (fewer, cheaper
        calls than gathering, weighting and scattering its entries); a large one is applied
        through its entries, O(B nnz)."""
        if self.is_identity:
            return r
        dense = self._dense_on(r.device, r.dtype)
        if dense is not None:
            return r @ dense
        rows, cols, weights = self._on(r.device, r.dtype)
        return r.new_zeros(r.shape[0], self.fine.n).index_add_(1, cols, r[:, rows] * weights)

    def dense(self) -> Tensor:
        """D as a dense (n_coarse, n_fine) float64 matrix (for tests and small sets)."""
        out = torch.zeros(self.coarse.n, self.fine.n, dtype=torch.float64)
        real = self.index >= 0
        rows = torch.arange(self.coarse.n)[:, None].expand_as(self.index)
        out[rows[real], self.index[real]] = self.weight[real]
        return out


def _padded(axis: list[list[int]]) -> Tensor:
    """Per coarse index its fine indices, as a (n_coarse, max(1, longest)) long tensor padded with -1."""
    out = torch.full((len(axis), max(1, max((len(a) for a in axis), default=0))), -1, dtype=torch.long)
    for i, a in enumerate(axis):
        out[i, :len(a)] = torch.tensor(a, dtype=torch.long)
    return out


def _two(value: Union[int, Sequence[int]]) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        return int(value[0]), int(value[1])
    return int(value), int(value)


# -- slots ------------------------------------------------------------------------------------
def full_slots(tokens: TokenSet) -> Tensor:
    """One window holding every token of the set in order: (1, n)."""
    return torch.arange(tokens.n)[None]


def window_slots(tokens: TokenSet, window: tuple[int, int], shift: tuple[int, int] = (0, 0),
                 pad_first: bool = True) -> Tensor:
    """Windows of the grid, row-major, padded at the bottom/right to window multiples:
    (nW, wh * ww) indices into the set (-1 = padding). See
    :class:`~vitexplain.layout.WindowGeometry` (shift = cyclic roll by minus the shift)."""
    from ..layout import WindowGeometry

    idx = WindowGeometry(tokens.grid, window, shift, pad_first).index()
    return torch.where(idx < 0, idx, idx + tokens.prefix)


def grid_slots(tokens: TokenSet, cells: tuple[int, int]) -> Tensor:
    """MaxViT's dilated *grid* partition: a (g_h, g_w) grid of cells, each window holding the
    tokens at the same offset in every cell. Token (i, j) with ``i = a * (H / g_h) + u`` sits
    in window ``u * (W / g_w) + v`` at slot ``a * g_w + b``: (nW, g_h * g_w)."""
    (h, w), (gh, gw) = tokens.grid, cells
    if h % gh or w % gw:
        raise UnsupportedMethodError(f"the grid {tokens.grid} is not a multiple of the attention grid {cells}")
    idx = torch.arange(h * w).view(gh, h // gh, gw, w // gw).permute(1, 3, 0, 2).reshape(-1, gh * gw)
    return idx + tokens.prefix
