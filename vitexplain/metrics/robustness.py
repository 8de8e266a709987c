"""How stable is an explanation: max- and avg-sensitivity (Yeh et al., NeurIPS 2019).

The explanation of inputs ``x + delta`` with ``delta`` drawn uniformly from the L-infinity ball of
radius ``r`` is compared with the explanation of ``x``: :func:`max_sensitivity` reports the largest
change over the samples, :func:`avg_sensitivity` the mean change. Lower is more stable; a constant
explanation is perfectly stable (0), so sensitivity is read alongside a faithfulness metric.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..errors import UsageError
from .seeding import image_generators, per_image_draws
from .validation import ArrayLike, check_images, check_maps, check_positive_int, check_seed, exact_dtype, real

__all__ = ["sensitivities", "max_sensitivity", "avg_sensitivity"]


def sensitivities(
    explain_fn: Callable[[Tensor], Tensor],
    images: ArrayLike,
    *,
    radius: float = 0.2,
    samples: int = 50,
    relative: bool = True,
    maps: Optional[ArrayLike] = None,
    seed: int = 0,
) -> Tensor:
    """The change of the explanation under each of ``samples`` random input perturbations.

    For sample ``s``, ``delta_s`` is uniform in ``[-radius, radius]`` independently per input element
    (the L-infinity ball of Yeh et al.'s experiments and of Quantus), drawn for image ``b`` from its own
    generator on the images' device, seeded by the image's values and ``seed``
    (:func:`vitexplain.metrics.seeding.image_generators`; ``torch.rand(image.shape) * 2 * radius - radius``,
    one draw per sample, in order), so an image's score does not depend on its place in the batch or on
    the other images (a batch scores as its images one by one); the change is
    ``||explain_fn(x + delta_s) - explain_fn(x)||_F``,
    divided by ``||explain_fn(x)||_F`` when ``relative``.

    Args:
        explain_fn: ``images (B, C, H, W) -> maps (B, h, w)``, called once on the images and once per
            sample with the perturbed batch. Fix the target explicitly: the predicted class may change
            under noise (e.g. ``lambda x: ex.explain(x, method="cdam", target=t).maps``).
        images: ``(B, C, H, W)`` preprocessed images, exactly what the model takes.
        radius: half-width of the uniform noise, in the units of ``images`` (Quantus's default 0.2).
        samples: number of perturbations.
        relative: divide by the norm of the unperturbed explanation (Quantus, and a change that does
            not depend on the map's scale); False gives Yeh et al.'s absolute norm of the difference.
        maps: the unperturbed explanations ``(B, h, w)`` if already computed (else ``explain_fn(images)``).
        seed: seed of the noise (each image's draws also depend on its values).

    Returns:
        ``(samples, B)`` float32 tensor of changes.

    Raises:
        UsageError: bad shapes, a map with NaN/inf, or (``relative``) an all-zero unperturbed map,
            whose relative change is undefined (drop the item or pass ``relative=False``).
    """
    images = check_images(images)
    radius = real(radius, "radius (in the units of the images)")
    if radius <= 0:
        raise UsageError(f"radius must be a finite number > 0 (in the units of the images), got {radius!r}")
    samples = check_positive_int(samples, "samples")
    seed = check_seed(seed)
    B = images.shape[0]
    reference = check_maps(explain_fn(images) if maps is None else maps, "explain_fn output", batch=B)
    dtype = exact_dtype(reference.device)
    reference = reference.to(dtype)
    norm = reference.flatten(1).norm(dim=1)
    if relative and bool((norm == 0).any()):
        raise UsageError(
            f"the explanations of batch items {(norm == 0).nonzero().flatten().tolist()[:10]} are all zero, so their "
            f"relative sensitivity is undefined; drop those items or pass relative=False"
        )
    generators = image_generators(images, seed)
    out = torch.empty(samples, B, dtype=dtype, device=reference.device)
    for s in range(samples):
        noise = per_image_draws(generators, images.shape[1:], "rand", images)
        perturbed = explain_fn(images + (2 * noise - 1) * radius)
        perturbed = check_maps(perturbed, f"explain_fn output (sample {s})", batch=B)
        if perturbed.shape != reference.shape:
            raise UsageError(
                f"explain_fn returned maps of shape {tuple(perturbed.shape)} for perturbed images, expected "
                f"{tuple(reference.shape)} as for the unperturbed ones"
            )
        out[s] = (perturbed.to(device=reference.device, dtype=dtype) - reference).flatten(1).norm(dim=1)
    return (out / norm if relative else out).float()


def max_sensitivity(
    explain_fn: Callable[[Tensor], Tensor],
    images: ArrayLike,
    *,
    radius: float = 0.2,
    samples: int = 50,
    relative: bool = True,
    maps: Optional[ArrayLike] = None,
    seed: int = 0,
) -> Tensor:
    """Max-sensitivity (Yeh et al. 2019): the largest change of the explanation under input noise.

    ``max_s ||Phi(x + delta_s) - Phi(x)|| / ||Phi(x)||`` over ``samples`` draws of ``delta`` uniform in
    the L-infinity ball of radius ``radius`` (a Monte Carlo estimate of the maximum over the ball, as in
    the paper). Yeh et al. define the absolute norm of the difference (``relative=False``); the
    division by ``||Phi(x)||`` (the default) is Quantus's (``quantus.MaxSensitivity``, which uses 200
    samples by default) and makes the score independent of the map's scale. Lower is more stable.

    Args: see :func:`sensitivities`.

    Returns:
        ``(B,)`` float32 tensor >= 0.
    """
    changes = sensitivities(explain_fn, images, radius=radius, samples=samples, relative=relative, maps=maps, seed=seed)
    return changes.amax(0)


def avg_sensitivity(
    explain_fn: Callable[[Tensor], Tensor],
    images: ArrayLike,
    *,
    radius: float = 0.2,
    samples: int = 50,
    relative: bool = True,
    maps: Optional[ArrayLike] = None,
    seed: int = 0,
) -> Tensor:
    """Avg-sensitivity (Yeh et al. 2019): the mean change of the explanation under input noise.

    ``mean_s ||Phi(x + delta_s) - Phi(x)|| / ||Phi(x)||`` over ``samples`` draws of ``delta`` uniform in
    the L-infinity ball of radius ``radius`` (the paper's expectation, estimated by Monte Carlo).
    ``relative=False`` gives the paper's absolute norm; the default relative change is Quantus's
    (``quantus.AvgSensitivity``). Lower is more stable.

    Args: see :func:`sensitivities`.

    Returns:
        ``(B,)`` float32 tensor >= 0.
    """
    changes = sensitivities(explain_fn, images, radius=radius, samples=samples, relative=relative, maps=maps, seed=seed)
    return changes.mean(0)
