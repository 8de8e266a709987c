"""Deletion / insertion (Petsiuk et al. 2018, RISE): does removing what the map ranks first hurt?

:func:`deletion_insertion` removes (inserts) patches in order of decreasing relevance, replacing them
with a baseline (blur, zero, mean, a tensor or a callable), and records the target's score;
:func:`deletion_auc` and :func:`insertion_auc` are the areas under those curves. The class and the
model's logits are read with :mod:`vitexplain.targets` (``resolve``, ``logits_of``), as the
explanation methods read them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checks import training_layers
from ..errors import NumericalError, TargetError, UsageError
from ..targets import logits_of, resolve
from .localisation import normalised_upsample, tie_groups
from .validation import ArrayLike, Size2, as_tensor, check_images, check_maps, check_positive_int, real, size2, whole

__all__ = ["DeletionInsertionResult", "deletion_insertion", "deletion_auc", "insertion_auc"]

ScoreFn = Union[str, Callable[[Tensor], Tensor]]
Baseline = Union[str, Tensor, Callable[[Tensor], Tensor]]


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
            try:  # (inf was an OverflowError: a kernel of infinite radius)
                sigma = real(blur_sigma, "blur_sigma") if blur_sigma is not None else max(images.shape[-2:]) / 16.0
            except UsageError:
                sigma = math.nan
            if not sigma > 0:
                raise UsageError(f"blur_sigma must be a finite number of pixels > 0, got {blur_sigma!r}")
            out = _gaussian_blur(images, float(sigma))
        else:
            raise UsageError(f"baseline must be 'blur', 'zero', 'mean', a tensor or a callable, got {baseline!r}")
    else:
        out = as_tensor(baseline, "baseline")
    out = as_tensor(out, "baseline").to(device=images.device, dtype=images.dtype)
    try:
        out = out.expand_as(images)
    except RuntimeError:
        raise UsageError(
            f"baseline must broadcast to the images' shape {tuple(images.shape)}, got {tuple(out.shape)}"
        ) from None
    if not bool(torch.isfinite(out).all()):  # (blamed on the model's logits before: "check the model's weights")
        raise UsageError("the baseline images hold NaN or infinite values, so every perturbed input would too; pass a "
                         "finite baseline ('blur', 'zero', 'mean', or a finite tensor / callable result)")
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
    """The (N, C) logits in a model's output (:func:`vitexplain.targets.logits_of`)."""
    try:
        logits = logits_of(out)
    except TargetError:
        logits = None
    if logits is None or logits.ndim != 2:
        shape = tuple(logits.shape) if logits is not None else type(out).__name__
        raise UsageError(f"the model must return logits of shape (N, C), got {shape}")
    return logits


def _scorer(model: Callable[[Tensor], Any], score: ScoreFn, caller: str) -> Callable[[Tensor], Tensor]:
    """``x (N, C, H, W) -> scores (N, classes)`` of the model; warns if the model is in training mode."""
    score_fn = _score_fn(score)
    if isinstance(model, nn.Module) and training_layers(model):  # (not a wrapper's own flag: the layers it runs)
        warnings.warn(
            f"{caller}: the model is in training mode (dropout, batch-norm updates); "
            "call model.eval() first for meaningful curves",
            stacklevel=3,
        )

    def run(x: Tensor) -> Tensor:
        logits = _logits(model(x))
        s = score_fn(logits)
        if not isinstance(s, Tensor) or s.ndim != 2 or s.shape[0] != x.shape[0]:
            raise UsageError(f"score must return (N, C) scores, got {getattr(s, 'shape', type(s))}")
        if logits.is_floating_point() and not bool(torch.isfinite(logits).all()):
            bad = int((~torch.isfinite(logits)).any(1).sum())
            raise NumericalError(
                f"{caller}: the model's logits are NaN or inf for {bad} of {x.shape[0]} (perturbed) inputs, so the "
                "curve would be meaningless: check the model's weights and the input's scale"
            )
        return s

    return run


def _target_scores(scores: Tensor, targets: Tensor, caller: str) -> Tensor:
    """``scores[n, targets[n]]`` (N,) of (N, C) scores; a NaN or inf among them is a NumericalError (the
    model's logits were finite, so the score function is at fault; other classes' scores may be -inf)."""
    vals = scores.gather(1, targets[:, None])[:, 0]
    if vals.is_floating_point() and not bool(torch.isfinite(vals).all()):
        raise NumericalError(
            f"{caller}: the score function returns NaN or inf for the target class on "
            f"{int((~torch.isfinite(vals)).sum())} of {vals.shape[0]} inputs, although the model's logits are "
            "finite: check the score function's arithmetic (a log of 0, a division by 0, ...)"
        )
    return vals


def _resolve_targets(run: Callable[[Tensor], Tensor], images: Tensor, target: Any, batch_size: int) -> Tensor:
    """The (B,) class whose score is recorded, on the images' device, resolved as the explanation
    methods resolve it (None = the class predicted on the unmodified image; out-of-range indices
    are a TargetError). Call under ``torch.no_grad()``."""
    B = images.shape[0]
    unmodified = torch.cat([run(images[i : i + batch_size]) for i in range(0, B, batch_size)])
    classes = resolve(_target_spec(target, B), unmodified).classes.to(images.device)
    _target_scores(unmodified, classes.to(unmodified.device), "the unmodified images")
    return classes


def _patch_grid(maps: Tensor, size: Tuple[int, int], patch: Optional[Size2]) -> Tuple[Tensor, Tensor]:
    """Return per-cell relevance (B, K) and the pixel -> cell label image (H, W) long.

    With ``patch`` the relevance of a patch is the mean of the map normalised to [0, 1] and upsampled in float64
    (:func:`~vitexplain.metrics.localisation.normalised_upsample`), and patches within
    :data:`~vitexplain.metrics.localisation.TIE_RTOL` of each other are set equal (their tie group's rank,
    negated), so that patches equal in exact arithmetic tie at any scale of the map (bilinear rounding ordered
    them, differently at 0.7x: curves moved by up to 0.04).
    """
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
    ph, pw = size2(patch, "patch")
    gh, gw = -(-H // ph), -(-W // pw)
    labels = (ys // ph)[:, None] * gw + (xs // pw)[None, :]
    up = normalised_upsample(maps, size)
    k = gh * gw
    sums = torch.zeros(maps.shape[0], k, device=dev, dtype=up.dtype).index_add_(1, labels.flatten(), up)
    counts = torch.bincount(labels.flatten(), minlength=k).to(up.dtype)
    return -tie_groups(sums / counts).to(up.dtype), labels


def _target_spec(target: Any, batch: int) -> Optional[Tensor]:
    """Check the form of a deletion/insertion target: None, an int or a (B,) integer sequence.

    Returns None or a (B,) long tensor on the CPU; the range is checked by
    :func:`vitexplain.targets.resolve` against the model's scores.
    """
    if target is None:
        return None
    if isinstance(target, bool) or callable(target):
        raise TargetError(f"target must be an int, a (B,) sequence of ints or None, got {target!r}")
    if isinstance(target, int):
        return torch.full((batch,), target, dtype=torch.long)
    names = [target] if isinstance(target, str) else list(target) if isinstance(target, (list, tuple)) else []
    if any(isinstance(n, str) for n in names):  # (an InputError said "must be a torch.Tensor or a NumPy array")
        raise TargetError(f"target must be class indices (an int or a ({batch},) sequence of ints), got label names "
                          f"{target!r}: pass the explanation's e.targets, or the names' indices in the model's labels")
    t = as_tensor(target, "target")
    if t.ndim == 0:
        t = t.expand(batch)
    if t.shape != (batch,) or t.is_floating_point() or t.dtype == torch.bool:
        raise TargetError(
            f"target must be an int or a ({batch},) integer sequence/tensor, got {t.dtype} {tuple(t.shape)}"
        )
    return t.long().cpu()


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
            map is min-max normalised, upsampled bilinearly to the image and averaged over each patch;
            patch means within 1e-5 of the range of each other tie (row-major order), so the order does not
            change with the map's scale. Edge patches may be smaller when the size does not divide the image.
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
    images = check_images(images)
    B, _, H, W = images.shape
    maps = check_maps(maps, batch=B).to(images.device)
    batch_size = check_positive_int(batch_size, "batch_size")
    scores, labels = _patch_grid(maps, (H, W), patch)
    K = scores.shape[1]
    if steps is None:
        steps = K
    try:
        steps = whole(steps, "steps")
    except UsageError:
        pass  # (the message below says the range)
    if not (isinstance(steps, int) and not isinstance(steps, bool) and 1 <= steps <= K):
        raise UsageError(f"steps must be an int in [1, {K}] (the number of patches), got {steps!r}")
    run = _scorer(model, score, "deletion_insertion")

    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(K, device=order.device).expand(B, K))
    counts = torch.arange(steps + 1, device=images.device) * K // steps  # (S+1,)
    fractions = counts.cpu().double() / K  # exact on CPU (float64 is unavailable on some devices)
    base = _baseline_images(images, baseline, blur_sigma)
    S1 = steps + 1

    with torch.no_grad():
        tgt = _resolve_targets(run, images, target, batch_size)
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
            vals = _target_scores(run(x), tgt[b], "deletion_insertion")
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
