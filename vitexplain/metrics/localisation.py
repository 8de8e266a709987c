"""Does a map point at the object? Pointing game and relevance mass against ground-truth masks.

- :func:`pointing_game` / :func:`pointing_accuracy` (Zhang et al. 2018): a hit if the map's maximum,
  at image resolution, lies inside the ground-truth mask dilated by a tolerance.
- :func:`relevance_mass` (Arras et al. 2022): positive relevance inside the mask over all positive
  relevance.
- :func:`relevance_rank_accuracy` (Arras et al. 2022): of the K = |mask| most relevant pixels, the
  fraction inside the mask; :func:`top_k_intersection` (Theiner et al. 2021): of the k most relevant
  pixels, the fraction inside the mask. Ties at the cut count by expectation (see :func:`top_k_inside`).

Maps are ``(B, h, w)`` at any resolution (a model's patch grid, or pixels); masks set the image
resolution ``(H, W)``.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UsageError
from .validation import ArrayLike, Size2, check_maps, check_masks, exact_dtype, real, size2, whole

__all__ = [
    "TOLERANCE_AT_224",
    "PEAK_RTOL",
    "default_tolerance",
    "upsample_maps",
    "peak_locations",
    "pointing_game",
    "pointing_accuracy",
    "relevance_mass",
    "top_k_inside",
    "TIE_RTOL",
    "normalised_upsample",
    "tie_groups",
    "relevance_rank_accuracy",
    "top_k_intersection",
]

#: Pointing-game tolerance in pixels at the reference resolution (Zhang et al. 2018: 15 px at 224 px).
TOLERANCE_AT_224 = 15

#: Pixels within this fraction of the map's value range below its maximum tie with the maximum
#: (:func:`peak_locations`). Far above float rounding (~1e-7), far below any real difference.
PEAK_RTOL = 1e-5


#: Upsampled pixels within this fraction of the map's range of each other are ties in a ranking
#: (:func:`top_k_inside`, ROAD's removal order), as :data:`PEAK_RTOL` for the peak: bilinear weights round
#: differently at different pixels (a constant 0.1 upsampled in float64 gives three values ~1e-17 apart), and a
#: float32 map's levels carry ~1e-7 of rounding, so values equal in exact arithmetic were ranked by that
#: rounding, which changes with the map's scale, instead of as the ties they are.
TIE_RTOL = PEAK_RTOL


def normalised_upsample(maps: Tensor, size: tuple[int, int]) -> Tensor:
    """Each map min-max normalised to [0, 1] in float64 (float32 on MPS), then upsampled bilinearly to ``size``.

    Args:
        maps: ``(B, h, w)`` checked maps.
        size: ``(H, W)``.

    Returns:
        ``(B, H * W)`` values in [0, 1] (0 everywhere for a constant map): invariant, up to rounding, to a
        positive affine rescaling of the map.
    """
    flat = maps.to(exact_dtype(maps.device)).flatten(1)
    low, high = flat.amin(1, keepdim=True), flat.amax(1, keepdim=True)
    span = high - low
    unit = torch.where(span > 0, (flat - low) / torch.where(span > 0, span, torch.ones_like(span)), torch.zeros_like(flat))
    if tuple(maps.shape[1:]) == tuple(size):
        return unit
    return F.interpolate(unit.view(-1, 1, *maps.shape[1:]), size=size, mode="bilinear", align_corners=False).flatten(1)


def tie_groups(values: Tensor) -> Tensor:
    """Rank of each value's tie group, 0 for the highest: values in [0, 1] (:func:`normalised_upsample`) tie when
    a chain of neighbours in sorted order each lie within :data:`TIE_RTOL` of the next.

    Args:
        values: ``(B, n)``.

    Returns:
        ``(B, n)`` long; a stable ascending sort of it orders the values from the highest, ties in index order.
    """
    ordered = torch.sort(values, dim=1, descending=True, stable=True)
    group = torch.zeros_like(ordered.indices)
    group[:, 1:] = torch.cumsum((ordered.values[:, :-1] - ordered.values[:, 1:] > TIE_RTOL).long(), 1)
    return torch.empty_like(group).scatter_(1, ordered.indices, group)


def default_tolerance(size: Size2) -> int:
    """Default pointing-game tolerance for an image size: 15 px at 224 px, scaled with the size.

    Args:
        size: image size ``(H, W)`` or an int for a square image.

    Returns:
        ``round(15 * max(H, W) / 224)`` pixels, rounding halves up (4 px at 64, 15 at 224, 30 at 448).
    """
    h, w = size2(size, "size")
    return int(math.floor(TOLERANCE_AT_224 * max(h, w) / 224 + 0.5))


def upsample_maps(maps: ArrayLike, size: Size2) -> Tensor:
    """Resize maps to an image size with bilinear interpolation (``align_corners=False``).

    Args:
        maps: ``(B, h, w)`` maps at any resolution.
        size: target ``(H, W)``.

    Returns:
        ``(B, H, W)`` float tensor on the maps' device. A map already at ``(H, W)`` is returned unchanged.
    """
    maps = check_maps(maps)
    size = size2(size, "size")
    if tuple(maps.shape[1:]) == size:
        return maps
    return F.interpolate(maps[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]


def _check_rtol(rtol: float) -> float:
    try:
        value = real(rtol, "rtol")
    except UsageError:
        value = math.nan
    if not 0 <= value < 1:
        raise UsageError(f"rtol must be a number in [0, 1) (a fraction of the map's range), got {rtol!r}")
    return value


def peak_locations(maps: ArrayLike, size: Size2, *, rtol: float = PEAK_RTOL) -> Tensor:
    """Location of each map's maximum at image resolution, invariant to positive affine rescaling.

    Each map is min-max normalised to [0, 1] (in float64), then upsampled bilinearly to ``size``.
    Every pixel within ``rtol`` of the upsampled maximum is a tied maximum; the peak is the tied
    pixel closest to the centroid of the tied set (the first such pixel in row-major order when
    several are equally close).

    Why: bilinear upsampling makes ties that are equal in exact arithmetic but not in floating
    point -- the 2 x 2 block around a grid cell's centre, and the replicated rows/columns at the
    image border (4 pixels deep at 8x) -- and which of them rounds highest changes when the map is
    multiplied by a constant, so a plain ``argmax`` moved the peak by up to 3 pixels (and turned a
    pointing-game hit into a miss). Normalising first makes the values, and so the tolerance,
    independent of the map's scale and offset; taking the tied set's centre, rather than its first
    pixel, puts the peak where the plateau is (the first pixel is biased towards the top left by
    up to the plateau's size). A constant map ties everywhere and peaks at the image centre
    (:func:`pointing_game` scores it a miss).

    Args:
        maps: ``(B, h, w)`` maps.
        size: image size ``(H, W)``.
        rtol: tie tolerance as a fraction of the map's value range (default :data:`PEAK_RTOL`);
            0 keeps only exact ties.

    Returns:
        ``(B, 2)`` long tensor of ``(row, col)`` pixel coordinates.
    """
    maps = check_maps(maps)
    h, w = size2(size, "size")
    rtol = _check_rtol(rtol)
    up = normalised_upsample(maps, (h, w))  # (B, H * W), values in [0, 1]
    tied = up >= up.amax(1, keepdim=True) - rtol
    rows = torch.arange(h, device=maps.device, dtype=up.dtype).repeat_interleave(w)
    cols = torch.arange(w, device=maps.device, dtype=up.dtype).repeat(h)
    count = tied.sum(1, keepdim=True).to(up.dtype)
    centre_r = (tied * rows).sum(1, keepdim=True) / count
    centre_c = (tied * cols).sum(1, keepdim=True) / count
    d2 = (rows - centre_r) ** 2 + (cols - centre_c) ** 2
    index = torch.where(tied, d2, torch.full_like(d2, math.inf)).argmin(1)  # first of equal minima
    return torch.stack([index // w, index % w], dim=1)


def pointing_game(
    maps: ArrayLike, masks: ArrayLike, *, tolerance: Optional[float] = None, rtol: float = PEAK_RTOL
) -> Tensor:
    """Pointing game (Zhang et al. 2018): does each map's maximum fall on the object?

    Each map's maximum at the mask resolution (:func:`peak_locations`: normalised, upsampled
    bilinearly, ties within ``rtol`` of the range resolved to the tied set's centre, so the hit does
    not change when a map is scaled by a positive constant or shifted) is a hit if it lies within
    ``tolerance`` pixels of a mask pixel, i.e. inside the mask dilated by a Euclidean disk of radius
    ``tolerance`` (distances between pixel centres). ``tolerance=0`` requires the peak to be inside
    the mask itself. A constant map (e.g. a clamped gradient map that is 0 everywhere) has no
    maximum to point with and is a miss wherever the object is; otherwise the image centre, where
    its tied set is centred, would count as a hit for every centred object.

    Args:
        maps: ``(B, h, w)`` maps at any resolution; signed maps are fine (only the maximum matters).
        masks: ``(B, H, W)`` ground-truth masks (bool, or numbers where nonzero is inside): one object
            or the union of several objects, at image resolution.
        tolerance: radius in pixels at mask resolution. Default ``round(15 * max(H, W) / 224)``
            (:func:`default_tolerance`): 15 px at 224 px as in the paper, 4 px at 64 px.
        rtol: tie tolerance of the maximum, as a fraction of each map's range (see
            :func:`peak_locations`).

    Returns:
        ``(B,)`` bool tensor of hits. The accuracy is ``hits.float().mean()`` (:func:`pointing_accuracy`).

    Raises:
        UsageError: shapes do not match, a map holds NaN/inf, tolerance is negative, or a mask is empty
            (the game is undefined without an object; Zhang et al. skip such images, so drop the item).
    """
    maps = check_maps(maps)
    masks = check_masks(masks, batch=maps.shape[0]).to(maps.device)
    b, h, w = masks.shape
    if tolerance is None:
        tolerance = default_tolerance((h, w))
    if not (isinstance(tolerance, numbers.Real) and not isinstance(tolerance, bool) and tolerance >= 0
            and math.isfinite(tolerance)):  # NumPy scalars too
        raise UsageError(f"tolerance must be a finite number of pixels >= 0, got {tolerance!r}")
    empty = ~masks.flatten(1).any(1)
    if bool(empty.any()):
        raise UsageError(
            f"masks of batch items {empty.nonzero().flatten().tolist()[:10]} are empty; the pointing game "
            f"is undefined for an image without the object, drop those items"
        )
    peaks = peak_locations(maps, (h, w), rtol=rtol)  # (B, 2)
    rows = torch.arange(h, device=maps.device)
    cols = torch.arange(w, device=maps.device)
    d2 = (rows[None, :, None] - peaks[:, 0, None, None]) ** 2 + (cols[None, None, :] - peaks[:, 1, None, None]) ** 2
    flat = maps.flatten(1)
    points = flat.amax(1) > flat.amin(1)  # a constant map points nowhere
    return (masks & (d2 <= float(tolerance) ** 2)).flatten(1).any(1) & points


def pointing_accuracy(
    maps: ArrayLike, masks: ArrayLike, *, tolerance: Optional[float] = None, rtol: float = PEAK_RTOL
) -> float:
    """Pointing-game accuracy: hits / all, over a batch.

    Args:
        maps: ``(B, h, w)`` maps.
        masks: ``(B, H, W)`` masks.
        tolerance: see :func:`pointing_game`.
        rtol: see :func:`pointing_game`.

    Returns:
        The fraction of hits, a Python float in [0, 1].
    """
    return float(pointing_game(maps, masks, tolerance=tolerance, rtol=rtol).float().mean().item())


def relevance_mass(maps: ArrayLike, masks: ArrayLike) -> Tensor:
    """Relevance mass accuracy (Arras et al. 2022): positive relevance inside the mask / all positive.

    The map is upsampled bilinearly to the mask resolution first, then negative values are set to 0.

    Args:
        maps: ``(B, h, w)`` maps at any resolution (signed maps: negative relevance is ignored).
        masks: ``(B, H, W)`` masks (bool, or nonzero = inside).

    Returns:
        ``(B,)`` float tensor in [0, 1]; 0 (not NaN) for a map with no positive relevance.
    """
    maps = check_maps(maps)
    masks = check_masks(masks, batch=maps.shape[0]).to(maps.device)
    pos = upsample_maps(maps, masks.shape[1:]).clamp(min=0).flatten(1)
    total = pos.sum(1)
    inside = (pos * masks.flatten(1)).sum(1)
    return torch.where(total > 0, inside / total.clamp(min=torch.finfo(pos.dtype).tiny), torch.zeros_like(total))


def top_k_inside(maps: ArrayLike, masks: ArrayLike, k: Tensor) -> Tensor:
    """How many of each map's ``k`` most relevant pixels lie inside the mask, ties counted by expectation.

    The map is min-max normalised and upsampled bilinearly to the mask resolution
    (:func:`normalised_upsample`) and ranked by its signed value. Pixels tied with the k-th value at the
    cut -- equal to it within :data:`TIE_RTOL` of the map's range, so that a plateau of equal cells stays
    a tie after upsampling, whatever the map's scale -- are a random draw in any ranking
    (``numpy.argsort`` and a stable sort take the first in memory order, i.e. the top rows): the count is
    the expectation over a uniformly random order of the tied pixels, ``g_in + (k - g) * e_in / e`` with
    ``g`` (``g_in``) the pixels above the k-th value (inside the mask) and ``e`` (``e_in``) those tied with
    it. Without ties at the cut this is the plain count; a constant map gets ``k * |mask| / (H * W)``,
    chance.

    Args:
        maps: ``(B, h, w)`` maps at any resolution.
        masks: ``(B, H, W)`` masks (bool, or nonzero = inside).
        k: ``(B,)`` integers in ``[1, H * W]``.

    Returns:
        ``(B,)`` float tensor (float64 except on MPS), the expected number of top-k pixels inside.
    """
    maps = check_maps(maps)
    masks = check_masks(masks, batch=maps.shape[0]).to(maps.device)
    dtype = exact_dtype(maps.device)
    a = normalised_upsample(maps, tuple(masks.shape[1:]))
    inside = masks.flatten(1)
    k = k.to(device=maps.device, dtype=torch.long)
    cut = torch.sort(a, dim=1, descending=True).values.gather(1, (k - 1)[:, None])  # the k-th value, (B, 1)
    above, tied = a > cut + TIE_RTOL, (a - cut).abs() <= TIE_RTOL
    g, g_in = above.sum(1), (above & inside).sum(1)
    e, e_in = tied.sum(1), (tied & inside).sum(1)
    return g_in.to(dtype) + (k - g).to(dtype) * e_in.to(dtype) / e.to(dtype)


def relevance_rank_accuracy(maps: ArrayLike, masks: ArrayLike) -> Tensor:
    """Relevance rank accuracy (Arras et al. 2022): of the K = |mask| most relevant pixels, the share inside.

    The map is upsampled bilinearly to the mask resolution and its pixels are ranked by signed
    relevance; the score is ``|top-K ∩ mask| / K``, 1 when the mask holds the K highest values. Ties
    at the cut count by expectation (:func:`top_k_inside`), so a constant map scores chance,
    ``K / (H * W)``. Quantus 0.6 (``quantus.RelevanceRankAccuracy``) computes the same with
    ``numpy.argsort``, which breaks ties by memory order; the two agree on maps without ties at the cut.

    Args:
        maps: ``(B, h, w)`` maps at any resolution.
        masks: ``(B, H, W)`` masks (bool, or nonzero = inside).

    Returns:
        ``(B,)`` float32 tensor in [0, 1].

    Raises:
        UsageError: a mask is empty (K = 0: undefined; Quantus returns NaN), or shapes do not match.
    """
    maps = check_maps(maps)
    masks = check_masks(masks, batch=maps.shape[0]).to(maps.device)
    size = masks.flatten(1).sum(1)
    if bool((size == 0).any()):
        raise UsageError(
            f"masks of batch items {(size == 0).nonzero().flatten().tolist()[:10]} are empty; relevance rank "
            f"accuracy is undefined without the object (K = 0), drop those items"
        )
    return (top_k_inside(maps, masks, size) / size.to(exact_dtype(maps.device))).float()


def top_k_intersection(maps: ArrayLike, masks: ArrayLike, k: int) -> Tensor:
    """Top-k intersection (Theiner et al. 2021): the share of the k most relevant pixels inside the mask.

    The map is upsampled bilinearly to the mask resolution and ranked by signed relevance; the score is
    ``|top-k ∩ mask| / k``, with ties at the cut counted by expectation (:func:`top_k_inside`). An empty
    mask scores 0. Quantus 0.6 (``quantus.TopKIntersection``, default k = 1000) computes the same with
    ``numpy.argsort`` (ties by memory order) and returns NaN for an empty mask; its optional
    ``concept_influence`` rescaling by ``H * W / |mask|`` is not applied here.

    Args:
        maps: ``(B, h, w)`` maps at any resolution.
        masks: ``(B, H, W)`` masks (bool, or nonzero = inside).
        k: number of top pixels, at mask resolution, in ``[1, H * W]``.

    Returns:
        ``(B,)`` float32 tensor in [0, 1].
    """
    maps = check_maps(maps)
    masks = check_masks(masks, batch=maps.shape[0]).to(maps.device)
    n = masks.shape[1] * masks.shape[2]
    try:
        k = whole(k, "k")
    except UsageError:
        pass  # (the message below says the range)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise UsageError(f"k must be an int in [1, {n}] (pixels at mask resolution), got {k!r}")
    counts = torch.full((maps.shape[0],), k, device=maps.device, dtype=torch.long)
    return (top_k_inside(maps, masks, counts) / k).float()
