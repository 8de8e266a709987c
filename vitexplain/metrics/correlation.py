"""Correlations between two batches of maps: Pearson, Spearman (average ranks) and class sensitivity.

- :func:`pearson_correlation` and :func:`rank_correlation` (Spearman, tied values get the average of
  the ranks they span, as ``scipy.stats.spearmanr``), per item, on the flattened maps;
- :func:`class_sensitivity`: the correlation between the maps of two classes on the same image
  (near 1 means the method ignores the class).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..errors import UsageError
from .validation import ArrayLike, as_tensor, check_maps, exact_dtype

__all__ = ["pearson_correlation", "rank_correlation", "class_sensitivity"]


def _pair(a: ArrayLike, b: ArrayLike) -> Tuple[Tensor, Tensor]:
    a = as_tensor(a, "a")
    b = as_tensor(b, "b")
    if a.ndim < 2 or a.shape != b.shape:
        raise UsageError(
            f"expected two batches of maps of the same shape (B, h, w), got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    a = check_maps(a.reshape(a.shape[0], 1, -1), "a")
    b = check_maps(b.reshape(b.shape[0], 1, -1), "b").to(a.device)
    return a.flatten(1), b.flatten(1)


def _average_ranks(x: Tensor) -> Tensor:
    """Ranks (0-based) along dim 1, ties get the average of the ranks they span. (B, n) -> (B, n)."""
    B, n = x.shape
    vals, idx = torch.sort(x, dim=1, stable=True)
    pos = torch.arange(n, device=x.device).expand(B, n)
    new = torch.ones_like(vals, dtype=torch.bool)
    new[:, 1:] = vals[:, 1:] != vals[:, :-1]
    first = torch.cummax(torch.where(new, pos, torch.zeros_like(pos)), dim=1).values
    last_flag = torch.ones_like(new)
    last_flag[:, :-1] = new[:, 1:]
    rev = torch.where(last_flag, (n - 1) - pos, torch.zeros_like(pos)).flip(1)
    last = (n - 1) - torch.cummax(rev, dim=1).values.flip(1)
    avg = (first + last).to(exact_dtype(x.device)) / 2
    return torch.empty_like(avg).scatter_(1, idx, avg)


def _pearson_rows(x: Tensor, y: Tensor, constant: Tensor, constant_value: float) -> Tensor:
    x = x.to(exact_dtype(x.device))
    y = y.to(x.dtype)
    x = x - x.mean(1, keepdim=True)
    y = y - y.mean(1, keepdim=True)
    den = torch.sqrt((x * x).sum(1) * (y * y).sum(1))
    r = ((x * y).sum(1) / torch.where(constant, torch.ones_like(den), den)).clamp(-1.0, 1.0)
    return torch.where(constant, torch.full_like(r, constant_value), r).float()


def _is_constant(x: Tensor) -> Tensor:
    return x.amax(1) == x.amin(1)


def pearson_correlation(a: ArrayLike, b: ArrayLike, *, constant_value: float = 0.0) -> Tensor:
    """Pearson correlation per item between two batches of maps, flattened.

    Args:
        a: ``(B, h, w)`` maps (any ``(B, ...)`` shape; flattened from dim 1).
        b: maps of the same shape as ``a``.
        constant_value: returned for an item where either map is constant (correlation undefined, 0/0).
            Default 0: a constant map carries no spatial information, so it is scored as uncorrelated
            with anything (this keeps batch means finite); pass ``float("nan")`` to get NaN instead.

    Returns:
        ``(B,)`` float32 tensor in [-1, 1].
    """
    x, y = _pair(a, b)
    return _pearson_rows(x, y, _is_constant(x) | _is_constant(y), constant_value)


def rank_correlation(a: ArrayLike, b: ArrayLike, *, constant_value: float = 0.0) -> Tensor:
    """Spearman rank correlation per item between two batches of maps, flattened.

    The Pearson correlation of the ranks, with tied values given the average of the ranks they span
    (as ``scipy.stats.spearmanr``). Ties matter: ReLU-clamped maps have many zeros.

    Args:
        a: ``(B, h, w)`` maps (any ``(B, ...)`` shape; flattened from dim 1).
        b: maps of the same shape as ``a``.
        constant_value: returned where either map is constant (all ranks tied, correlation undefined).
            Default 0 ("no rank agreement"): a constant map, e.g. an all-zero Grad-CAM after
            randomisation, has no ranking to agree with, and 0 keeps averages finite. Note that two
            identical constant maps also score 0. Pass ``float("nan")`` to get NaN, as scipy does.

    Returns:
        ``(B,)`` float32 tensor in [-1, 1].
    """
    x, y = _pair(a, b)
    constant = _is_constant(x) | _is_constant(y)
    return _pearson_rows(_average_ranks(x), _average_ranks(y), constant, constant_value)


def class_sensitivity(
    maps_a: ArrayLike, maps_b: ArrayLike, *, method: str = "pearson", constant_value: float = 0.0
) -> Tensor:
    """Class sensitivity: correlation between the maps of two different classes on the same image.

    Near 1 means the method ignores the class (raw attention and rollout are expected to); low or
    negative values mean the map depends on the class.

    Args:
        maps_a: ``(B, h, w)`` maps for one class.
        maps_b: ``(B, h, w)`` maps for another class, same images.
        method: ``"pearson"`` (default, on the flattened map values; signed maps keep their sign) or
            ``"spearman"`` (:func:`rank_correlation`).
        constant_value: value where either map is constant (see :func:`pearson_correlation`).

    Returns:
        ``(B,)`` float32 tensor in [-1, 1].
    """
    if method == "pearson":
        return pearson_correlation(maps_a, maps_b, constant_value=constant_value)
    if method == "spearman":
        return rank_correlation(maps_a, maps_b, constant_value=constant_value)
    raise UsageError(f"method must be 'pearson' or 'spearman', got {method!r}")
