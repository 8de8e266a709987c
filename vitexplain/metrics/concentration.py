"""How concentrated is a map: sparseness (Gini index), complexity (entropy) and histogram entropy.

- :func:`sparseness` (Chalasani et al. 2020): the Gini index of the absolute relevance; 0 for a
  uniform map, ``1 - 1/n`` for a map with one nonzero cell. Higher is sparser.
- :func:`complexity` (Bhatt et al. 2020): the Shannon entropy of the absolute relevance normalised
  to sum to 1; ``log n`` for a uniform map, 0 for one nonzero cell. Lower is simpler.
- :func:`histogram_entropy`: the entropy of the histogram of a map's values, the complexity that
  efficient MPRT (Hedström et al. 2023) compares.

All are computed on the map's own grid (``n = h * w`` cells) unless ``size`` upsamples it first:
compare methods at the same resolution, as ``log n`` and ``1 - 1/n`` grow with ``n``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .localisation import upsample_maps
from .validation import ArrayLike, Size2, check_maps, check_positive_int, exact_dtype

__all__ = ["sparseness", "complexity", "histogram_entropy"]


def _absolute(maps: ArrayLike, size: Optional[Size2]) -> Tensor:
    """``|maps|`` flattened to (B, n) in float64 (float32 on MPS), upsampled to ``size`` first if given."""
    maps = check_maps(maps)
    if size is not None:
        maps = upsample_maps(maps, size)
    return maps.to(exact_dtype(maps.device)).flatten(1).abs()


def sparseness(maps: ArrayLike, *, size: Optional[Size2] = None) -> Tensor:
    """Sparseness (Chalasani et al. 2020): the Gini index of each map's absolute relevance.

    With ``a_(1) <= ... <= a_(n)`` the sorted absolute values,
    ``G = sum_k (2k - n - 1) a_(k) / (n sum_k a_(k))`` (Hurley & Rickard's Gini index, the paper's
    definition); 0 for a uniform map, ``1 - 1/n`` for a single nonzero cell, invariant to scaling.
    An all-zero map is scored as a uniform one (0, the limit of adding a constant that goes to 0):
    it concentrates relevance nowhere.

    Quantus 0.6 (``quantus.Sparseness``) follows the same formula after normalising the map by its
    maximum and adding 1e-7 to every cell, which lowers the index by about ``1e-7 n / sum |a|``
    (negligible unless the map is nearly zero).

    Args:
        maps: ``(B, h, w)`` maps at any resolution; signed maps are fine (absolute values are used).
        size: upsample the maps bilinearly to this ``(H, W)`` first (compare methods at one resolution).

    Returns:
        ``(B,)`` float32 tensor in ``[0, 1 - 1/n]``.
    """
    a = torch.sort(_absolute(maps, size), dim=1).values
    n = a.shape[1]
    k = torch.arange(1, n + 1, device=a.device, dtype=a.dtype)
    total = a.sum(1)
    gini = ((2 * k - n - 1) * a).sum(1) / (n * torch.where(total > 0, total, torch.ones_like(total)))
    return torch.where(total > 0, gini, torch.zeros_like(gini)).float()


def complexity(maps: ArrayLike, *, size: Optional[Size2] = None) -> Tensor:
    """Complexity (Bhatt et al. 2020): the entropy of each map's normalised absolute relevance.

    ``p_i = |a_i| / sum_j |a_j|`` and ``H = -sum_i p_i log p_i`` (natural log, ``0 log 0 = 0``), the
    paper's definition; 0 for a single nonzero cell, ``log n`` for a uniform map, invariant to
    scaling. An all-zero map is scored as a uniform one (``log n``).

    Quantus 0.6 (``quantus.Complexity``) computes ``-sum p log(p + 1e-12)`` after normalising by the
    maximum: the same up to ~1e-12 per cell; it returns NaN for an all-zero map.

    Args:
        maps: ``(B, h, w)`` maps at any resolution; signed maps are fine (absolute values are used).
        size: upsample the maps bilinearly to this ``(H, W)`` first (compare methods at one resolution).

    Returns:
        ``(B,)`` float32 tensor in ``[0, log n]``.
    """
    a = _absolute(maps, size)
    total = a.sum(1, keepdim=True)
    p = a / torch.where(total > 0, total, torch.ones_like(total))
    h = torch.special.entr(p).sum(1)  # -p log p, 0 at p = 0
    return torch.where(total[:, 0] > 0, h, torch.full_like(h, math.log(a.shape[1]))).float()


def histogram_entropy(maps: ArrayLike, *, bins: int = 100) -> Tensor:
    """Entropy of the histogram of each map's values (the complexity of Hedström et al.'s eMPRT).

    The values of a map (signed, on its own grid) are counted in ``bins`` equal-width bins spanning
    the map's minimum to maximum (as ``numpy.histogram(a, bins)``: the last bin includes the maximum);
    ``H = -sum_b q_b log q_b`` with ``q_b`` the fraction of cells in bin ``b``. A constant map has
    every cell in one bin: 0.

    Args:
        maps: ``(B, h, w)`` maps at any resolution.
        bins: number of bins (the paper and Quantus: 100).

    Returns:
        ``(B,)`` float32 tensor in ``[0, log min(bins, h * w)]``.
    """
    maps = check_maps(maps)
    bins = check_positive_int(bins, "bins")
    a = maps.to(exact_dtype(maps.device)).flatten(1)
    low, high = a.amin(1, keepdim=True), a.amax(1, keepdim=True)
    span = high - low
    safe = torch.where(span > 0, span, torch.ones_like(span))
    # numpy's binning: edges low + k * (span / bins) (the last one exactly high), a first guess from the
    # scaled value, then corrected against the edges, so values on an edge land where numpy puts them
    edges = low + torch.arange(bins + 1, device=a.device, dtype=a.dtype) * (safe / bins)
    edges[:, -1:] = torch.where(span > 0, high, low + 1)
    index = torch.floor((a - low) * (bins / safe)).long().clamp(0, bins - 1)
    index = index - (a < edges.gather(1, index)).long()
    index = index + ((a >= edges.gather(1, index + 1)) & (index != bins - 1)).long()
    counts = torch.zeros(a.shape[0], bins, device=a.device, dtype=a.dtype).scatter_add_(1, index, torch.ones_like(a))
    q = counts / a.shape[1]
    return torch.special.entr(q).sum(1).float()
