"""ROAD (Rong et al., ICML 2022): remove pixels by relevance and fill them by noisy linear imputation.

Deletion with a constant or blurred baseline lets the model read *where* pixels were removed (the
mask's shape leaks the explanation's ranking). ROAD -- RemOve And Debias -- fills each removed pixel
with the weighted mean of its 8 neighbours (solved jointly for all removed pixels: a sparse linear
system) plus a little Gaussian noise, so the filled region carries no trace of the mask. The model's
score of the target class is recorded as the most (MoRF) or least (LeRF) relevant pixels are removed.

- :func:`noisy_linear_imputation`: the imputation (the paper's ``NoisyLinearImputer``), batched,
  in torch on the images' device;
- :func:`road`: the curves, with :class:`RoadResult`.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UsageError
from .localisation import normalised_upsample, tie_groups
from .perturbation import ScoreFn, _resolve_targets, _scorer, _target_scores
from .seeding import image_seeds
from .validation import (ArrayLike, as_tensor, check_images, check_maps, check_masks, check_positive_int, check_seed,
                         exact_dtype)

__all__ = ["RoadResult", "noisy_linear_imputation", "road", "ROAD_FRACTIONS"]

#: Default fractions of pixels removed: 10 %, 20 %, ..., 90 %, as in Rong et al. (2022).
ROAD_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

# The solver stops when every system's residual is below this fraction of its right-hand side
# (float64: the imputed values then agree with a direct sparse solve to ~1e-5 of the pixel range,
# far below the 0.01 noise the paper adds).
_CG_RTOL = 1e-6

Noise = Union[float, Sequence[float], Tensor]


class RoadResult(NamedTuple):
    """Result of :func:`road`.

    Attributes:
        curves: ``(B, F)`` the target's score after removing ``fractions[f]`` of the pixels.
        correct: ``(B, F)`` bool, whether the top-scoring class still is the target (the paper's
            accuracy is ``correct.float().mean(0)`` when the target is the true label).
        fractions: ``(F,)`` fraction of the pixels removed at each point, as given.
        targets: ``(B,)`` long, the class whose score was recorded.
        order: ``"morf"`` or ``"lerf"``.
    """

    curves: Tensor
    correct: Tensor
    fractions: Tensor
    targets: Tensor
    order: str


def _neighbour_sum(x: Tensor) -> Tensor:
    """Weighted sum of each pixel's 8 neighbours (1/6 sides, 1/12 corners), zero outside the image.

    ``(N, C, H, W) -> (N, C, H, W)``. The weights are the separable ``[1, 2, 1] x [1, 2, 1] / 12``
    filter without its centre (4/12): two 1-D passes over shifted slices, exact in float64 on every
    device and cheaper than a depthwise convolution on CPUs.
    """
    rows = F.pad(x, (0, 0, 1, 1))
    v = rows[..., :-2, :] + 2.0 * x + rows[..., 2:, :]
    cols = F.pad(v, (1, 1))
    return (cols[..., :-2] + 2.0 * v + cols[..., 2:]) / 12.0 - x / 3.0


def _noise_std(noise: Noise, channels: int, like: Tensor) -> Tensor:
    """The noise's standard deviation as a (1, C, 1, 1) tensor."""
    std = as_tensor(noise, "noise").to(device=like.device, dtype=like.dtype).flatten()
    if std.numel() == 1:
        std = std.expand(channels)
    if std.numel() != channels or not bool(torch.isfinite(std).all()) or bool((std < 0).any()):
        raise UsageError(f"noise must be a standard deviation >= 0, or one per channel ({channels}), got {noise!r}")
    return std.view(1, channels, 1, 1)


def noisy_linear_imputation(
    images: ArrayLike,
    removed: ArrayLike,
    *,
    noise: Noise = 0.01,
    generator: Union[None, torch.Generator, Sequence[torch.Generator]] = None,
) -> Tensor:
    """Fill removed pixels with the weighted mean of their neighbours plus noise (Rong et al. 2022).

    The paper's imputation: every removed pixel ``i`` satisfies ``x_i = sum_n w_n x_n / sum_n w_n``
    over its neighbours ``n`` inside the image, with weight 1/6 for the 4 side neighbours and 1/12
    for the 4 corner neighbours; removed neighbours are unknowns too, so all removed pixels of an image
    are solved for jointly (per channel). The system is symmetric positive definite whenever at least
    one pixel is kept; it is solved by conjugate gradients preconditioned with its diagonal, in float64
    (float32 on MPS), to a relative residual of 1e-6 (the paper uses a direct sparse solver; the
    results agree to ~1e-5 of the pixel range). Then ``noise * N(0, 1)`` is added to each removed
    pixel. Kept pixels are returned unchanged.

    Imputation is linear, so imputing a mean/std-normalised image equals normalising the imputed image:
    pass the model's inputs. Only the noise depends on the units: the paper adds 0.01 to pixels in
    [0, 1], which is ``0.01 / std`` per channel for normalised inputs.

    Args:
        images: ``(B, C, H, W)`` float images.
        removed: ``(B, H, W)`` bool (or nonzero = removed), the pixels to fill; not all of an image.
        noise: standard deviation of the noise added to the filled pixels, in the units of ``images``:
            a float, or one per channel.
        generator: the random generator of the noise (on the images' device), or one per image; default
            the global one.

    Returns:
        ``(B, C, H, W)`` images of the input dtype, with the removed pixels filled.

    Raises:
        UsageError: shapes do not match, or every pixel of an image is removed (nothing to impute from).
    """
    images = check_images(images)
    B, C, H, W = images.shape
    removed = check_masks(removed, "removed", batch=B).to(images.device)
    if tuple(removed.shape[1:]) != (H, W):
        raise UsageError(f"removed must have shape ({B}, {H}, {W}) to match the images, got {tuple(removed.shape)}")
    everything = removed.flatten(1).all(1)
    if bool(everything.any()):
        raise UsageError(
            f"every pixel of batch items {everything.nonzero().flatten().tolist()[:10]} is removed; the imputation "
            f"needs at least one kept pixel (remove a fraction < 1)"
        )
    dtype = exact_dtype(images.device)
    x = images.to(dtype)
    unknown = removed[:, None].to(dtype)  # (B, 1, H, W)
    degree = _neighbour_sum(torch.ones(1, 1, H, W, dtype=dtype, device=images.device))  # weights inside the image
    rhs = _neighbour_sum(x * (1 - unknown)) * unknown

    def apply(v: Tensor) -> Tensor:  # the system matrix on the removed pixels (v is 0 on kept ones)
        return (degree * v - _neighbour_sum(v)) * unknown

    filled = _conjugate_gradients(apply, rhs, unknown / degree, max_iter=20 * (H + W) + 100)
    std = _noise_std(noise, C, x)
    if bool((std > 0).any()):
        if generator is None or isinstance(generator, torch.Generator):
            draws = torch.randn(x.shape, generator=generator, device=x.device, dtype=dtype)
        else:
            if len(generator) != B:
                raise UsageError(f"generator must be one torch.Generator or one per image ({B}), got {len(generator)}")
            shape = x.shape[1:]
            draws = torch.stack([torch.randn(shape, generator=g, device=x.device, dtype=dtype) for g in generator])
        filled = filled + std * draws
    return torch.where(removed[:, None], filled, x).to(images.dtype)


def _conjugate_gradients(apply: Callable[[Tensor], Tensor], rhs: Tensor, precond: Tensor, max_iter: int) -> Tensor:
    """Solve ``apply(v) = rhs`` for every (N, C) system at once; preconditioned CG, zero start.

    ``rhs`` and ``precond`` (the inverse diagonal, 0 off the unknowns) are ``(N, C, H, W)`` or broadcast
    to it; dot products run over ``(H, W)``.
    """

    def dot(a: Tensor, b: Tensor) -> Tensor:
        return (a * b).sum((2, 3), keepdim=True)

    def safe_div(a: Tensor, b: Tensor) -> Tensor:
        return torch.where(b > 0, a / torch.where(b > 0, b, torch.ones_like(b)), torch.zeros_like(a))

    v = torch.zeros_like(rhs)
    r = rhs.clone()
    z = precond * r
    p = z
    rz = dot(r, z)
    goal = _CG_RTOL * dot(rhs, rhs).sqrt()
    for _ in range(max_iter):
        if bool((dot(r, r).sqrt() <= goal).all()):
            return v
        ap = apply(p)
        alpha = safe_div(rz, dot(p, ap))
        v = v + alpha * p
        r = r - alpha * ap
        z = precond * r
        rz_next = dot(r, z)
        p = z + safe_div(rz_next, rz) * p
        rz = rz_next
    worst = float((dot(r, r).sqrt() / dot(rhs, rhs).sqrt().clamp(min=1e-300)).max())
    warnings.warn(
        f"noisy_linear_imputation: the solver stopped after {max_iter} iterations at a relative residual of "
        f"{worst:.1e} (goal {_CG_RTOL:.0e}); the filled pixels are approximate",
        RuntimeWarning,
        stacklevel=3,
    )
    return v


def _generator(seed: int, *keys: int, device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """A generator seeded by ``(seed, *keys)`` (tuples of ints hash the same in every process)."""
    return torch.Generator(device=device).manual_seed(hash((seed,) + keys) & 0x7FFF_FFFF_FFFF_FFFF)


def _removal_order(values: Tensor, generator: torch.Generator) -> Tensor:
    """Indices of ``values`` (n,) from the highest to the lowest; ties in random (seeded) order.

    Values in [0, 1] (:func:`~vitexplain.metrics.localisation.normalised_upsample`) tie when a chain of
    neighbours in sorted order each lie within :data:`~vitexplain.metrics.localisation.TIE_RTOL` of the next
    (the rounding of bilinear weights on a plateau of equal cells; exact ties before)."""
    rank = tie_groups(values[None])[0]  # 0 for the highest tie group
    shuffle = torch.randperm(values.numel(), generator=generator).to(values.device)
    by_group = torch.sort(rank[shuffle], stable=True).indices
    return shuffle[by_group]


def _check_fractions(fractions: Sequence[float]) -> Tensor:
    """The fractions as a float64 CPU tensor, each in [0, 1)."""
    listed = fractions.tolist() if isinstance(fractions, Tensor) else list(fractions)
    values = torch.as_tensor(listed, dtype=torch.float64)
    if values.ndim != 1 or values.numel() == 0 or not bool(((values >= 0) & (values < 1)).all()):
        raise UsageError(
            f"fractions must be a non-empty sequence of fractions of the pixels in [0, 1) (the imputation needs "
            f"a kept pixel), got {fractions!r}"
        )
    return values


def road(
    model: Callable[[Tensor], Any],
    images: ArrayLike,
    maps: ArrayLike,
    target: Any = None,
    *,
    order: str = "morf",
    fractions: Sequence[float] = ROAD_FRACTIONS,
    noise: Noise = 0.01,
    score: ScoreFn = "softmax",
    batch_size: int = 64,
    seed: int = 0,
) -> RoadResult:
    """ROAD, RemOve And Debias (Rong et al., ICML 2022): the score as relevant pixels are imputed.

    Each map is min-max normalised and upsampled bilinearly to the image size and its pixels are
    ranked by relevance (signed: the most positive first); ties (equal within
    :data:`~vitexplain.metrics.localisation.TIE_RTOL` of the map's range: a plateau of equal cells stays a tie
    after upsampling) are ranked in a random order drawn from ``seed`` (the paper adds 1e-4 Gaussian noise to
    the min-max normalised map, which also reorders values within 1e-4 of the range of each other). For each fraction ``p`` the first
    ``floor(p * H * W)`` pixels of the ranking (``"morf"``, most relevant first) or of the reversed
    ranking (``"lerf"``, least relevant first) are removed and filled by
    :func:`noisy_linear_imputation`, and ``score(model(x))[:, target]`` is recorded. A faithful map
    makes the MoRF curve fall fast and the LeRF curve stay high; the paper reports both, as accuracy
    and as the target's probability, since the two orders can rank explanations differently.

    Quantus 0.6 (``quantus.ROAD``) implements MoRF accuracy only, with the same imputation; it fails on
    3-channel images (its pixel indices run over channels x pixels while the imputation expects
    pixels), so it agrees with this function only on single-channel images.

    The model runs under ``torch.no_grad()`` on the images' device, ``batch_size`` (image, fraction)
    pairs at a time; its training flag is left as found (put it in ``eval()`` first). The tie order of
    an image and its noise at each number of removed pixels come from generators seeded by the image's
    own values and ``seed`` (:mod:`vitexplain.metrics.seeding`), so an image's curve does not depend on
    its place in the batch, on the other images, on the other fractions or on ``batch_size`` (beyond
    the solver's tolerance): a batch scores as its images one by one.

    Args:
        model: a callable taking ``(N, C, H, W)`` and returning logits ``(N, classes)`` (or an object
            with ``.logits``, or a tuple whose first item is the logits).
        images: ``(B, C, H, W)`` preprocessed images, exactly what the model takes.
        maps: ``(B, h, w)`` relevance maps at any resolution.
        target: the class whose score is recorded: an int, a ``(B,)`` sequence/tensor of ints, or None
            for the class the model predicts on the unmodified image.
        order: ``"morf"`` (most relevant first) or ``"lerf"`` (least relevant first).
        fractions: fractions of the pixels to remove, each in [0, 1); default 0.1, 0.2, ..., 0.9.
        noise: standard deviation of the imputation noise in the units of ``images`` (a float or one per
            channel). The paper's 0.01 is for pixels in [0, 1]; for mean/std-normalised inputs pass
            ``[0.01 / s for s in std]``.
        score: ``"softmax"``, ``"sigmoid"`` or a callable ``logits (N, C) -> scores (N, C)``.
        batch_size: (image, fraction) pairs per forward pass (bounds memory).
        seed: seed of the noise and of the tie order (each image's draws also depend on its values).

    Returns:
        :class:`RoadResult` with ``curves (B, F)``, ``correct (B, F)``, ``fractions (F,)``, ``targets (B,)``.
    """
    if order not in ("morf", "lerf"):
        raise UsageError(f"order must be 'morf' (most relevant first) or 'lerf' (least relevant first), got {order!r}")
    images = check_images(images)
    B, C, H, W = images.shape
    maps = check_maps(maps, batch=B).to(images.device)
    batch_size = check_positive_int(batch_size, "batch_size")
    seed = check_seed(seed)
    frac = _check_fractions(fractions)
    counts = torch.floor(frac * (H * W) + 1e-9).long()  # pixels removed at each fraction (the paper: int(p * N))
    run = _scorer(model, score, "road")
    _noise_std(noise, C, images)  # fail before any forward pass
    n_frac = frac.numel()
    dev = images.device

    up = normalised_upsample(maps, (H, W))  # (B, H * W) in [0, 1]: ties of a plateau kept at any scale
    tie_seeds, noise_seeds = image_seeds(images, seed, 0), image_seeds(images, seed, 1)  # per image, by content
    rank = torch.stack([_removal_order(up[b], _generator(tie_seeds[b])) for b in range(B)])  # most relevant first
    if order == "lerf":
        rank = rank.flip(1)
    position = torch.empty_like(rank).scatter_(1, rank, torch.arange(H * W, device=dev).expand(B, -1))

    curves = torch.empty(B * n_frac, device=dev)
    correct = torch.empty(B * n_frac, dtype=torch.bool, device=dev)
    with torch.no_grad():
        tgt = _resolve_targets(run, images, target, batch_size)
        for start in range(0, B * n_frac, batch_size):
            pairs = torch.arange(start, min(start + batch_size, B * n_frac))
            items, steps = pairs // n_frac, pairs % n_frac
            removed = (position[items.to(dev)] < counts[steps].to(dev)[:, None]).view(-1, H, W)
            generators = [_generator(noise_seeds[int(b)], int(counts[f]), device=dev) for b, f in zip(items, steps)]
            x = noisy_linear_imputation(images[items.to(dev)], removed, noise=noise, generator=generators)
            scores = run(x)
            t = tgt[items.to(dev)]
            curves[pairs.to(dev)] = _target_scores(scores, t, "road").to(curves.dtype)
            correct[pairs.to(dev)] = scores.argmax(1) == t
    curves, correct = curves.view(B, n_frac), correct.view(B, n_frac)
    return RoadResult(curves=curves, correct=correct, fractions=frac.to(curves.dtype), targets=tgt, order=order)
