"""How good is a map: metrics that score saliency maps against ground truth and the model.

Definitions follow ``references.md`` ("Metrics"):

- :func:`pointing_game` / :func:`pointing_accuracy` (Zhang et al. 2018): a hit if the map's maximum,
  at image resolution, lies inside the ground-truth mask dilated by a tolerance.
- :func:`relevance_mass` (Arras et al. 2022): positive relevance inside the mask over all positive
  relevance.
- :func:`deletion_insertion`, :func:`deletion_auc`, :func:`insertion_auc` (Petsiuk et al. 2018, RISE):
  patches removed (inserted) in order of decreasing relevance, the target probability recorded.
- :func:`rank_correlation` (Spearman, average ranks for ties) and :func:`pearson_correlation`.
- :func:`randomization_check` (Adebayo et al. 2018): model-parameter randomisation, top layer first.
- :func:`class_sensitivity`: correlation between the maps of two classes on the same image.

Everything is batched and stays in torch on the device of its inputs. Maps are ``(B, h, w)`` at any
resolution (a model's patch grid, or pixels); masks and images set the image resolution ``(H, W)``.
NumPy arrays are accepted wherever a tensor is (converted with :func:`torch.as_tensor`). Shapes are
validated with ``ValueError`` messages that name the expected shape; a NaN or infinite value in a map is
an error, never a silent NaN score.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import InputError, TargetError, UsageError

__all__ = [
    "default_tolerance",
    "upsample_maps",
    "peak_locations",
    "pointing_game",
    "pointing_accuracy",
    "relevance_mass",
    "DeletionInsertionResult",
    "deletion_insertion",
    "deletion_auc",
    "insertion_auc",
    "rank_correlation",
    "pearson_correlation",
    "class_sensitivity",
    "RandomizationResult",
    "randomization_layers",
    "randomization_check",
]

ArrayLike = Any  # torch.Tensor, numpy.ndarray or a nested sequence of numbers
Size2 = Union[int, Tuple[int, int], Sequence[int]]
ScoreFn = Union[str, Callable[[Tensor], Tensor]]
Baseline = Union[str, Tensor, Callable[[Tensor], Tensor]]

#: Pointing-game tolerance in pixels at the reference resolution (Zhang et al. 2018: 15 px at 224 px).
TOLERANCE_AT_224 = 15


# --------------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------------


def _as_tensor(x: ArrayLike, name: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except Exception as exc:  # noqa: BLE001 - re-raised with a clear message
        raise InputError(f"{name} must be a torch.Tensor or a NumPy array, got {type(x).__name__}") from exc


def _check_finite(x: Tensor, name: str) -> None:
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).flatten(1).any(1).nonzero().flatten().tolist()
        raise UsageError(
            f"{name} contains NaN or infinite values (batch items {bad[:10]}"
            f"{' ...' if len(bad) > 10 else ''}); fix the explanation method or drop those items"
        )


def _maps(maps: ArrayLike, name: str = "maps", batch: Optional[int] = None) -> Tensor:
    """Validate a batch of maps: (B, h, w), finite, returned as a floating tensor (float32 or float64)."""
    maps = _as_tensor(maps, name)
    if maps.ndim != 3:
        raise UsageError(
            f"{name} must have shape (B, h, w) (one 2-D map per image), got shape {tuple(maps.shape)}; "
            f"for a single map use map[None]"
        )
    if batch is not None and maps.shape[0] != batch:
        raise UsageError(f"{name} must have shape ({batch}, h, w) to match the batch, got {tuple(maps.shape)}")
    if maps.shape[1] == 0 or maps.shape[2] == 0:
        raise UsageError(f"{name} has an empty spatial size {tuple(maps.shape[1:])}")
    if maps.dtype == torch.complex64 or maps.dtype == torch.complex128:
        raise UsageError(f"{name} must be real-valued, got dtype {maps.dtype}")
    if maps.dtype != torch.float64:
        maps = maps.float()
    _check_finite(maps, name)
    return maps.detach()


def _masks(masks: ArrayLike, name: str = "masks", batch: Optional[int] = None) -> Tensor:
    masks = _as_tensor(masks, name)
    if masks.ndim != 3:
        raise UsageError(
            f"{name} must have shape (B, H, W) (one boolean mask per image at image resolution), "
            f"got shape {tuple(masks.shape)}; for several objects pass their union, masks.any(dim=1)"
        )
    if batch is not None and masks.shape[0] != batch:
        raise UsageError(f"{name} must have shape ({batch}, H, W) to match maps, got {tuple(masks.shape)}")
    if masks.dtype != torch.bool:
        _check_finite(masks.float() if not masks.is_floating_point() else masks, name)
        masks = masks != 0
    return masks


def _size2(size: Size2, name: str) -> Tuple[int, int]:
    if isinstance(size, int):
        out = (size, size)
    else:
        out = tuple(int(s) for s in size)
        if len(out) != 2:
            raise UsageError(f"{name} must be an int or a pair (H, W), got {size!r}")
    if out[0] <= 0 or out[1] <= 0:
        raise UsageError(f"{name} must be positive, got {size!r}")
    return out  # type: ignore[return-value]


def _corr_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


# --------------------------------------------------------------------------------------------------
# pointing game and relevance mass
# --------------------------------------------------------------------------------------------------


def default_tolerance(size: Size2) -> int:
    """Default pointing-game tolerance for an image size: 15 px at 224 px, scaled with the size.

    Args:
        size: image size ``(H, W)`` or an int for a square image.

    Returns:
        ``round(15 * max(H, W) / 224)`` pixels, rounding halves up (4 px at 64, 15 at 224, 30 at 448).
    """
    h, w = _size2(size, "size")
    return int(math.floor(TOLERANCE_AT_224 * max(h, w) / 224 + 0.5))


def upsample_maps(maps: ArrayLike, size: Size2) -> Tensor:
    """Resize maps to an image size with bilinear interpolation (``align_corners=False``).

    Args:
        maps: ``(B, h, w)`` maps at any resolution.
        size: target ``(H, W)``.

    Returns:
        ``(B, H, W)`` float tensor on the maps' device. A map already at ``(H, W)`` is returned unchanged.
    """
    maps = _maps(maps)
    size = _size2(size, "size")
    if tuple(maps.shape[1:]) == size:
        return maps
    return F.interpolate(maps[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]


def peak_locations(maps: ArrayLike, size: Size2) -> Tensor:
    """Location of each map's maximum at image resolution.

    The map is upsampled bilinearly to ``size`` first. Ties (plateaus, constant maps, and the 2x2
    block of equal pixels bilinear upsampling puts around a grid cell's centre) resolve to the *first*
    maximum in row-major order, as :func:`torch.argmax` does.

    Args:
        maps: ``(B, h, w)`` maps.
        size: image size ``(H, W)``.

    Returns:
        ``(B, 2)`` long tensor of ``(row, col)`` pixel coordinates.
    """
    up = upsample_maps(maps, size)
    w = up.shape[2]
    flat = up.flatten(1).argmax(dim=1)
    return torch.stack([flat // w, flat % w], dim=1)


def pointing_game(maps: ArrayLike, masks: ArrayLike, *, tolerance: Optional[float] = None) -> Tensor:
    """Pointing game (Zhang et al. 2018): does each map's maximum fall on the object?

    Each map is upsampled bilinearly to the mask resolution; its maximum (first maximum in row-major
    order on ties, see :func:`peak_locations`) is a hit if it lies within ``tolerance`` pixels of a mask
    pixel, i.e. inside the mask dilated by a Euclidean disk of radius ``tolerance`` (distances between
    pixel centres). ``tolerance=0`` requires the peak to be inside the mask itself.

    Args:
        maps: ``(B, h, w)`` maps at any resolution; signed maps are fine (only the maximum matters).
        masks: ``(B, H, W)`` ground-truth masks (bool, or numbers where nonzero is inside): one object
            or the union of several objects, at image resolution.
        tolerance: radius in pixels at mask resolution. Default ``round(15 * max(H, W) / 224)``
            (:func:`default_tolerance`): 15 px at 224 px as in the paper, 4 px at 64 px.

    Returns:
        ``(B,)`` bool tensor of hits. The accuracy is ``hits.float().mean()`` (:func:`pointing_accuracy`).

    Raises:
        ValueError: shapes do not match, a map holds NaN/inf, tolerance is negative, or a mask is empty
            (the game is undefined without an object; Zhang et al. skip such images, so drop the item).
    """
    maps = _maps(maps)
    masks = _masks(masks, batch=maps.shape[0]).to(maps.device)
    b, h, w = masks.shape
    if tolerance is None:
        tolerance = default_tolerance((h, w))
    if not (isinstance(tolerance, (int, float)) and tolerance >= 0 and math.isfinite(tolerance)):
        raise UsageError(f"tolerance must be a finite number of pixels >= 0, got {tolerance!r}")
    empty = ~masks.flatten(1).any(1)
    if bool(empty.any()):
        raise UsageError(
            f"masks of batch items {empty.nonzero().flatten().tolist()[:10]} are empty; the pointing game "
            f"is undefined for an image without the object, drop those items"
        )
    peaks = peak_locations(maps, (h, w))  # (B, 2)
    rows = torch.arange(h, device=maps.device)
    cols = torch.arange(w, device=maps.device)
    d2 = (rows[None, :, None] - peaks[:, 0, None, None]) ** 2 + (cols[None, None, :] - peaks[:, 1, None, None]) ** 2
    return (masks & (d2 <= float(tolerance) ** 2)).flatten(1).any(1)


def pointing_accuracy(maps: ArrayLike, masks: ArrayLike, *, tolerance: Optional[float] = None) -> float:
    """Pointing-game accuracy: hits / all, over a batch.

    Args:
        maps: ``(B, h, w)`` maps.
        masks: ``(B, H, W)`` masks.
        tolerance: see :func:`pointing_game`.

    Returns:
        The fraction of hits, a Python float in [0, 1].
    """
    return float(pointing_game(maps, masks, tolerance=tolerance).float().mean().item())


def relevance_mass(maps: ArrayLike, masks: ArrayLike) -> Tensor:
    """Relevance mass accuracy (Arras et al. 2022): positive relevance inside the mask / all positive.

    The map is upsampled bilinearly to the mask resolution first, then negative values are set to 0.

    Args:
        maps: ``(B, h, w)`` maps at any resolution (signed maps: negative relevance is ignored).
        masks: ``(B, H, W)`` masks (bool, or nonzero = inside).

    Returns:
        ``(B,)`` float tensor in [0, 1]; 0 (not NaN) for a map with no positive relevance.
    """
    maps = _maps(maps)
    masks = _masks(masks, batch=maps.shape[0]).to(maps.device)
    pos = upsample_maps(maps, masks.shape[1:]).clamp(min=0).flatten(1)
    total = pos.sum(1)
    inside = (pos * masks.flatten(1)).sum(1)
    return torch.where(total > 0, inside / total.clamp(min=torch.finfo(pos.dtype).tiny), torch.zeros_like(total))


# --------------------------------------------------------------------------------------------------
# deletion / insertion
# --------------------------------------------------------------------------------------------------


class DeletionInsertionResult(NamedTuple):
    """Result of :func:`deletion_insertion`.

    Attributes:
        curves: ``(B, steps + 1)`` target score after removing (inserting) ``fractions[s]`` of the patches;
            ``curves[:, 0]`` is the unmodified image (deletion) or the baseline image (insertion).
        auc: ``(B,)`` area under each curve, trapezoid rule over ``fractions`` in [0, 1].
        fractions: ``(steps + 1,)`` fraction of patches removed (inserted) at each step, 0 ... 1.
        targets: ``(B,)`` long, the class whose score was recorded.
    """

    curves: Tensor
    auc: Tensor
    fractions: Tensor
    targets: Tensor


def _gaussian_blur(images: Tensor, sigma: float) -> Tensor:
    """Separable Gaussian blur of (B, C, H, W), radius ceil(3 sigma), replicate padding at the borders."""
    radius = max(1, int(math.ceil(3.0 * sigma)))
    x = torch.arange(-radius, radius + 1, device=images.device, dtype=images.dtype)
    k = torch.exp(-(x**2) / (2.0 * sigma**2))
    k = k / k.sum()
    c = images.shape[1]
    out = F.pad(images, (radius, radius, 0, 0), mode="replicate")
    out = F.conv2d(out, k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    out = F.pad(out, (0, 0, radius, radius), mode="replicate")
    return F.conv2d(out, k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


def _baseline_images(images: Tensor, baseline: Baseline, blur_sigma: Optional[float]) -> Tensor:
    if callable(baseline) and not isinstance(baseline, (str, Tensor)):
        out = baseline(images)
    elif isinstance(baseline, str):
        if baseline == "zero":
            out = torch.zeros_like(images)
        elif baseline == "mean":
            out = images.mean(dim=(2, 3), keepdim=True).expand_as(images)
        elif baseline == "blur":
            sigma = blur_sigma if blur_sigma is not None else max(images.shape[-2:]) / 16.0
            if not sigma > 0:
                raise UsageError(f"blur_sigma must be > 0, got {blur_sigma!r}")
            out = _gaussian_blur(images, float(sigma))
        else:
            raise UsageError(f"baseline must be 'blur', 'zero', 'mean', a tensor or a callable, got {baseline!r}")
    else:
        out = _as_tensor(baseline, "baseline")
    out = _as_tensor(out, "baseline").to(device=images.device, dtype=images.dtype)
    try:
        out = out.expand_as(images)
    except RuntimeError:
        raise UsageError(
            f"baseline must broadcast to the images' shape {tuple(images.shape)}, got {tuple(out.shape)}"
        ) from None
    return out


def _score_fn(score: ScoreFn) -> Callable[[Tensor], Tensor]:
    if callable(score) and not isinstance(score, str):
        return score
    if score == "softmax":
        return lambda z: torch.softmax(z.float(), dim=-1)
    if score == "sigmoid":
        return lambda z: torch.sigmoid(z.float())
    raise UsageError(
        f"score must be 'softmax' (single-label), 'sigmoid' (multi-label) or a callable "
        f"logits (N, C) -> scores (N, C), got {score!r}"
    )


def _logits(out: Any) -> Tensor:
    if hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, Tensor) or out.ndim != 2:
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise UsageError(f"the model must return logits of shape (N, C), got {shape}")
    return out


def _patch_grid(maps: Tensor, size: Tuple[int, int], patch: Optional[Size2]) -> Tuple[Tensor, Tensor]:
    """Return per-cell relevance (B, K) and the pixel -> cell label image (H, W) long."""
    H, W = size
    dev = maps.device
    ys = torch.arange(H, device=dev)
    xs = torch.arange(W, device=dev)
    if patch is None:
        _, h, w = maps.shape
        if h > H or w > W:
            raise UsageError(f"maps of grid {(h, w)} are finer than the images {(H, W)}; pass patch=")
        labels = (ys * h // H)[:, None] * w + (xs * w // W)[None, :]
        return maps.flatten(1), labels
    ph, pw = _size2(patch, "patch")
    gh, gw = -(-H // ph), -(-W // pw)
    labels = (ys // ph)[:, None] * gw + (xs // pw)[None, :]
    up = upsample_maps(maps, size).flatten(1)
    k = gh * gw
    sums = torch.zeros(maps.shape[0], k, device=dev, dtype=up.dtype).index_add_(1, labels.flatten(), up)
    counts = torch.bincount(labels.flatten(), minlength=k).to(up.dtype)
    return sums / counts, labels


def _targets(target: Any, batch: int, device: torch.device) -> Optional[Tensor]:
    if target is None:
        return None
    if isinstance(target, bool):
        raise TargetError(f"target must be an int, a (B,) sequence of ints or None, got {target!r}")
    if isinstance(target, int):
        return torch.full((batch,), target, dtype=torch.long, device=device)
    t = _as_tensor(target, "target")
    if t.ndim == 0:
        t = t.expand(batch)
    if t.shape != (batch,) or t.is_floating_point() or t.dtype == torch.bool:
        raise TargetError(
            f"target must be an int or a ({batch},) integer sequence/tensor, got {t.dtype} {tuple(t.shape)}"
        )
    return t.to(device=device, dtype=torch.long)


def deletion_insertion(
    model: Callable[[Tensor], Any],
    images: ArrayLike,
    maps: ArrayLike,
    target: Any = None,
    *,
    mode: str = "deletion",
    baseline: Baseline = "blur",
    steps: Optional[int] = None,
    patch: Optional[Size2] = None,
    score: ScoreFn = "softmax",
    batch_size: int = 64,
    blur_sigma: Optional[float] = None,
) -> DeletionInsertionResult:
    """Deletion / insertion curves and AUC (Petsiuk et al. 2018, RISE), patch-wise.

    The image is divided into a grid of K patches, each patch gets a relevance, and patches are ordered
    by decreasing relevance with a *stable* sort: ties keep row-major order (top-left first), so the
    result is deterministic. At step ``s = 0 .. steps`` the first ``n_s = floor(s * K / steps)`` patches
    are replaced by the baseline (deletion) or copied from the image into the baseline (insertion), and
    ``score(model(x))[:, target]`` is recorded. Lower deletion AUC and higher insertion AUC are better.

    The model runs under ``torch.no_grad()`` on the images' device, in chunks of ``batch_size`` images
    over all (image, step) pairs; its training flag is left as found (put it in ``eval()`` first).

    Args:
        model: a callable (usually an ``nn.Module``) taking ``(N, C, H, W)`` and returning logits
            ``(N, classes)`` (or an object with ``.logits``, or a tuple whose first item is the logits).
        images: ``(B, C, H, W)`` preprocessed images, exactly what the model takes.
        maps: ``(B, h, w)`` relevance maps. With ``patch=None`` the map's own grid is the patch grid
            (each pixel belongs to the map cell it falls in; the grid must not be finer than the image).
        target: the class whose score is recorded: an int, a ``(B,)`` sequence/tensor of ints, or None
            for the class the model predicts on the unmodified image.
        mode: ``"deletion"`` or ``"insertion"``.
        baseline: ``"blur"`` (Gaussian blur, sigma ``blur_sigma``, default ``max(H, W) / 16`` px: 14 px at
            224), ``"zero"`` (zeros in the model's input space: the dataset mean colour for
            mean/std-normalised inputs), ``"mean"`` (each image's per-channel mean), a tensor
            broadcastable to ``(B, C, H, W)``, or a callable ``images -> (B, C, H, W)``.
        steps: number of steps (curve has ``steps + 1`` points); default K (one patch per step).
            At most K.
        patch: instead of the map's grid, use patches of this size in pixels (int or ``(ph, pw)``); the
            map is upsampled bilinearly to the image and averaged over each patch. Edge patches may be
            smaller when the size does not divide the image.
        score: ``"softmax"`` (single-label probability), ``"sigmoid"`` (multi-label) or a callable
            ``logits (N, C) -> scores (N, C)`` (e.g. ``lambda z: z`` for raw logits).
        batch_size: images per forward pass (bounds memory).
        blur_sigma: standard deviation of the blur baseline in pixels.

    Returns:
        :class:`DeletionInsertionResult` with ``curves (B, steps + 1)``, ``auc (B,)``,
        ``fractions (steps + 1,)`` and ``targets (B,)``.
    """
    if mode not in ("deletion", "insertion"):
        raise UsageError(f"mode must be 'deletion' or 'insertion', got {mode!r}")
    images = _as_tensor(images, "images")
    if images.ndim != 4:
        raise UsageError(f"images must have shape (B, C, H, W), got {tuple(images.shape)}")
    if not images.is_floating_point():
        raise UsageError(f"images must be the preprocessed float tensor the model takes, got {images.dtype}")
    B, _, H, W = images.shape
    maps = _maps(maps, batch=B).to(images.device)
    if not (isinstance(batch_size, int) and batch_size > 0):
        raise UsageError(f"batch_size must be a positive int, got {batch_size!r}")
    scores, labels = _patch_grid(maps, (H, W), patch)
    K = scores.shape[1]
    if steps is None:
        steps = K
    if not (isinstance(steps, int) and 1 <= steps <= K):
        raise UsageError(f"steps must be an int in [1, {K}] (the number of patches), got {steps!r}")
    score_fn = _score_fn(score)
    if isinstance(model, nn.Module) and model.training:
        warnings.warn(
            "deletion_insertion: the model is in training mode (dropout, batch-norm updates); "
            "call model.eval() first for meaningful curves",
            stacklevel=2,
        )

    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(K, device=order.device).expand(B, K))
    counts = torch.arange(steps + 1, device=images.device) * K // steps  # (S+1,)
    fractions = counts.cpu().double() / K  # exact on CPU (float64 is unavailable on some devices)
    base = _baseline_images(images, baseline, blur_sigma)
    S1 = steps + 1

    def run(x: Tensor) -> Tensor:
        s = score_fn(_logits(model(x)))
        if not isinstance(s, Tensor) or s.ndim != 2 or s.shape[0] != x.shape[0]:
            raise UsageError(f"score must return (N, C) scores, got {getattr(s, 'shape', type(s))}")
        return s

    with torch.no_grad():
        tgt = _targets(target, B, images.device)
        if tgt is None:
            tgt = torch.cat([run(images[i : i + batch_size]).argmax(1) for i in range(0, B, batch_size)])
        flat: Optional[Tensor] = None
        total = B * S1
        for start in range(0, total, batch_size):
            idx = torch.arange(start, min(start + batch_size, total), device=images.device)
            b, s = idx // S1, idx % S1
            changed = (rank[b] < counts[s][:, None])[:, labels][:, None]  # (n, 1, H, W)
            if mode == "deletion":
                x = torch.where(changed, base[b], images[b])
            else:
                x = torch.where(changed, images[b], base[b])
            out = run(x)
            if bool((tgt < 0).any()) or bool((tgt >= out.shape[1]).any()):
                raise TargetError(f"target {tgt.tolist()} out of range for {out.shape[1]} classes")
            vals = out.gather(1, tgt[b][:, None])[:, 0]
            if flat is None:
                flat = torch.empty(total, dtype=vals.dtype, device=vals.device)
            flat[idx.to(vals.device)] = vals
    if flat is None:  # pragma: no cover - total > 0 always scores at least one batch
        raise UsageError("no perturbed input was scored")
    curves = flat.view(B, S1)
    auc = torch.trapezoid(curves, fractions.to(device=curves.device, dtype=curves.dtype), dim=1)
    return DeletionInsertionResult(curves=curves, auc=auc, fractions=fractions.to(curves.dtype), targets=tgt)


def deletion_auc(
    model: Callable[[Tensor], Any], images: ArrayLike, maps: ArrayLike, target: Any = None, **kwargs: Any
) -> Tensor:
    """Deletion AUC (lower is better): ``deletion_insertion(..., mode="deletion").auc``, shape ``(B,)``.

    Keyword arguments are those of :func:`deletion_insertion`.
    """
    return deletion_insertion(model, images, maps, target, mode="deletion", **kwargs).auc


def insertion_auc(
    model: Callable[[Tensor], Any], images: ArrayLike, maps: ArrayLike, target: Any = None, **kwargs: Any
) -> Tensor:
    """Insertion AUC (higher is better): ``deletion_insertion(..., mode="insertion").auc``, shape ``(B,)``.

    Keyword arguments are those of :func:`deletion_insertion`.
    """
    return deletion_insertion(model, images, maps, target, mode="insertion", **kwargs).auc


# --------------------------------------------------------------------------------------------------
# correlations
# --------------------------------------------------------------------------------------------------


def _pair(a: ArrayLike, b: ArrayLike) -> Tuple[Tensor, Tensor]:
    a = _as_tensor(a, "a")
    b = _as_tensor(b, "b")
    if a.ndim < 2 or a.shape != b.shape:
        raise UsageError(
            f"expected two batches of maps of the same shape (B, h, w), got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    a = _maps(a.reshape(a.shape[0], 1, -1), "a")
    b = _maps(b.reshape(b.shape[0], 1, -1), "b").to(a.device)
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
    avg = (first + last).to(_corr_dtype(x.device)) / 2
    return torch.empty_like(avg).scatter_(1, idx, avg)


def _pearson_rows(x: Tensor, y: Tensor, constant: Tensor, constant_value: float) -> Tensor:
    x = x.to(_corr_dtype(x.device))
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


# --------------------------------------------------------------------------------------------------
# model parameter randomisation
# --------------------------------------------------------------------------------------------------


class RandomizationResult(NamedTuple):
    """Result of :func:`randomization_check`.

    Attributes:
        layers: the module names, in randomisation order (top / output side first).
        correlations: ``(len(layers), B)`` rank correlation between the original map and the map after
            step k (cascading: layers ``0..k`` randomised; independent: layer k only).
        reference: ``(B, h, w)`` maps of the unrandomised model.
        maps: ``(len(layers), B, h, w)`` maps after each step, or None unless ``return_maps=True``.
    """

    layers: List[str]
    correlations: Tensor
    reference: Tensor
    maps: Optional[Tensor]


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def randomization_layers(model: nn.Module) -> List[str]:
    """Default layer order for :func:`randomization_check`: top (output side) first.

    The model's named children that hold parameters, in registration order, reversed; children that
    are plain containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) are expanded into
    their own children, so a timm ViT gives ``head, norm, blocks.11, ..., blocks.0, patch_embed`` and a
    ResNet ``fc, layer4.1, layer4.0, ..., bn1, conv1``. Parameters owned directly by the root module
    (e.g. a ViT's ``cls_token`` and ``pos_embed``) are not in any layer and are never randomised.

    Args:
        model: the model.

    Returns:
        Module names (as in ``model.named_modules()``), output side first.
    """
    names: List[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if next(child.parameters(), None) is None:
                continue
            if isinstance(child, _CONTAINERS):
                walk(child, full + ".")
            else:
                names.append(full)

    walk(model, "")
    return names[::-1]


def _reinit_(module: nn.Module, std: float) -> None:
    """Re-initialise every parameter of ``module``: reset_parameters() where a submodule has one,
    else normal(0, std)."""
    handled = set()
    with torch.no_grad():
        for m in module.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
                handled.update(id(p) for p in m.parameters(recurse=False))
        for p in module.parameters():
            if id(p) not in handled:
                p.normal_(0.0, std)


def randomization_check(
    model: nn.Module,
    explain_fn: Callable[[nn.Module], Tensor],
    *,
    layers: Optional[Sequence[str]] = None,
    mode: str = "cascading",
    seed: int = 0,
    absolute: bool = False,
    init_std: float = 0.02,
    return_maps: bool = False,
) -> RandomizationResult:
    """Model-parameter randomisation test (Adebayo et al. 2018).

    Works on a deep copy: the caller's model (parameters, buffers, training flag) is never modified.
    The reference maps come from the unrandomised copy. Then, for each layer in order (top first),
    its parameters are re-initialised -- ``reset_parameters()`` on every submodule that has one (Linear,
    Conv, LayerNorm, ...), ``normal(0, init_std)`` for any other parameter -- and ``explain_fn`` is run on
    the randomised copy. ``"cascading"`` keeps earlier layers randomised (top-down cascade);
    ``"independent"`` randomises one layer at a time on a fresh copy. The rank correlation
    (:func:`rank_correlation`) with the reference must fall for a method that explains the model.

    Randomisation is seeded: layer k is initialised after ``torch.manual_seed(seed + k)`` inside
    :func:`torch.random.fork_rng`, so results are reproducible and the global RNG state is untouched
    (layer k gets the same weights in both modes). ``explain_fn`` runs outside the forked RNG.

    Args:
        model: the model to test (left untouched).
        explain_fn: ``model -> (B, h, w)`` maps; it receives the (randomised) copy, so build any
            explainer inside it, e.g. ``lambda m: vx.Explainer(m).explain(x, method="cdam", target=t).maps``.
            Fix the target explicitly: the predicted class changes when the model is randomised.
        layers: module names (``model.named_modules()``) in randomisation order, top first; default
            :func:`randomization_layers`.
        mode: ``"cascading"`` or ``"independent"``.
        seed: seed of the re-initialisation.
        absolute: compare ``|maps|`` (Adebayo et al. report both signed and absolute rank correlations).
        init_std: standard deviation for parameters no ``reset_parameters()`` covers.
        return_maps: also return the maps of every step.

    Returns:
        :class:`RandomizationResult` with ``layers``, ``correlations (len(layers), B)``,
        ``reference (B, h, w)`` and ``maps (len(layers), B, h, w)`` or None.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("cascading", "independent"):
        raise UsageError(f"mode must be 'cascading' or 'independent', got {mode!r}")
    modules = dict(model.named_modules())
    names = list(layers) if layers is not None else randomization_layers(model)
    if not names:
        raise UsageError("no layers to randomise: the model has no child modules with parameters; pass layers=")
    unknown = [n for n in names if n not in modules or n == ""]
    if unknown:
        avail = [n for n in modules if n][:20]
        raise UsageError(f"unknown layer names {unknown}; expected names from model.named_modules(), e.g. {avail}")
    cuda_devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})

    def explain(m: nn.Module, what: str) -> Tensor:
        maps = explain_fn(m)
        return _maps(maps, f"explain_fn output ({what})")

    def randomise(m: nn.Module, k: int) -> None:
        with torch.random.fork_rng(devices=cuda_devices):
            torch.manual_seed(seed + k)
            _reinit_(dict(m.named_modules())[names[k]], init_std)

    work = copy.deepcopy(model)
    reference = explain(work, "original model")
    ref_cmp = reference.abs() if absolute else reference
    corrs: List[Tensor] = []
    kept: List[Tensor] = []
    for k, name in enumerate(names):
        if mode == "independent" and k > 0:
            work = copy.deepcopy(model)
        randomise(work, k)
        maps = explain(work, f"after randomising {name!r}").to(reference.device)
        if maps.shape != reference.shape:
            raise UsageError(
                f"explain_fn returned maps of shape {tuple(maps.shape)} after randomising {name!r}, "
                f"expected {tuple(reference.shape)} as for the original model"
            )
        corrs.append(rank_correlation(ref_cmp, maps.abs() if absolute else maps))
        if return_maps:
            kept.append(maps)
    del work
    return RandomizationResult(
        layers=names,
        correlations=torch.stack(corrs),
        reference=reference,
        maps=torch.stack(kept) if return_maps else None,
    )
