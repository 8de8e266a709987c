"""Model-parameter randomisation, repaired (Hedström et al. 2023/24): efficient and smooth MPRT.

- :func:`efficient_mprt` (eMPRT): instead of correlating maps layer by layer, compare the complexity
  (histogram entropy) of the explanation of the trained model with that of the fully randomised
  model. A method that explains the model gets noisier -- more complex -- when the weights carry no
  information: higher is better.
- :func:`smooth_mprt` (sMPRT): the layer-by-layer randomisation test of
  :func:`~vitexplain.metrics.sanity.randomization_check` on explanations averaged over noisy copies of
  the input, which removes the noise that made the original test unreliable.

Both work on deep copies (:func:`~vitexplain.metrics.sanity.randomized_copy`): the caller's model is
left exactly as found. Layer ``k`` is re-initialised after seeding with ``seed + k`` (Quantus 0.6 seeds
every layer alike, so its layers of the same shape get identical weights).
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence

from torch import Tensor, nn

from ..errors import UsageError
from .concentration import histogram_entropy
from .sanity import RandomizationResult, _layer_names, randomization_check, randomized_copy
from .seeding import image_generators, per_image_draws
from .validation import check_images, check_maps, check_positive_int, check_seed, exact_dtype, real

__all__ = ["EfficientMPRTResult", "efficient_mprt", "smooth_mprt"]


class EfficientMPRTResult(NamedTuple):
    """Result of :func:`efficient_mprt`.

    Attributes:
        scores: ``(B,)`` relative rise in complexity, ``(H_random - H) / H``; higher is better
            (the explanation depends on the weights). The ratio ``H_random / H`` is ``scores + 1``.
        complexity: ``(B,)`` histogram entropy ``H`` of the trained model's explanations.
        complexity_randomized: ``(B,)`` histogram entropy ``H_random`` after full randomisation.
        layers: the module names that were randomised.
    """

    scores: Tensor
    complexity: Tensor
    complexity_randomized: Tensor
    layers: List[str]


def efficient_mprt(
    model: nn.Module,
    explain_fn: Callable[[nn.Module], Tensor],
    *,
    layers: Optional[Sequence[str]] = None,
    bins: int = 100,
    seed: int = 0,
    init_std: float = 0.02,
) -> EfficientMPRTResult:
    """Efficient MPRT (Hedström et al. 2023): the rise in explanation complexity under full randomisation.

    ``H`` is the entropy of the histogram of the explanation's values (:func:`histogram_entropy`,
    ``bins`` equal bins over the map's range; the paper's complexity, 100 bins), computed for the
    trained model and for a copy whose layers are all re-initialised (:func:`randomized_copy`; the
    order does not matter when every layer is randomised). The score is the relative rise
    ``(H_random - H) / H``, as Quantus 0.6 (``quantus.EfficientMPRT``, by the paper's authors)
    reports it; the paper's rate of change ``H_random / H`` is the score plus one.

    Where Quantus differs: it re-seeds every layer with the same seed (same-shaped layers get identical
    weights) and randomises every module that has ``reset_parameters`` (here: the parameterised children
    of :func:`randomization_layers`, which also covers parameters without ``reset_parameters``).

    Args:
        model: the model (left untouched: the randomised model is a deep copy).
        explain_fn: ``model -> (B, h, w)`` maps; it receives the trained model and then the randomised
            copy, so build any explainer inside it, e.g.
            ``lambda m: vx.Explainer(m).explain(x, method="cdam", target=t).maps``. Fix the target
            explicitly: the predicted class changes when the model is randomised.
        layers: module names to randomise; default :func:`randomization_layers` (all of them).
        bins: histogram bins of the complexity.
        seed: seed of the re-initialisation (layer ``k`` gets ``seed + k``).
        init_std: standard deviation for parameters no ``reset_parameters()`` covers.

    Returns:
        :class:`EfficientMPRTResult`.

    Raises:
        UsageError: an explanation of the trained model is constant (``H = 0``: the relative rise is
            undefined; drop the item), or the maps of the two models differ in shape.
    """
    names = _layer_names(model, layers)
    bins = check_positive_int(bins, "bins")
    if bins < 2:  # (one bin holds every value: each map's entropy is 0, reported as "constant explanations")
        raise UsageError(f"bins must be at least 2 for a histogram entropy that can rise, got {bins}")
    seed = check_seed(seed)
    reference = check_maps(explain_fn(model), "explain_fn output (original model)")
    h = histogram_entropy(reference, bins=bins)
    flat = (h == 0).nonzero().flatten().tolist()
    if flat:
        raise UsageError(
            f"the explanations of batch items {flat[:10]} are constant (histogram entropy 0), so the relative rise "
            f"of efficient MPRT is undefined; drop those items"
        )
    randomized = randomized_copy(model, names, seed=seed, init_std=init_std)
    maps = check_maps(explain_fn(randomized), "explain_fn output (randomised model)")
    del randomized
    if maps.shape != reference.shape:
        raise UsageError(
            f"explain_fn returned maps of shape {tuple(maps.shape)} for the randomised model, expected "
            f"{tuple(reference.shape)} as for the original model"
        )
    h_random = histogram_entropy(maps, bins=bins).to(h.device)
    return EfficientMPRTResult(scores=(h_random - h) / h, complexity=h, complexity_randomized=h_random, layers=names)


def smooth_mprt(
    model: nn.Module,
    explain_fn: Callable[[nn.Module, Tensor], Tensor],
    images: Tensor,
    *,
    samples: int = 50,
    noise: float = 0.1,
    layers: Optional[Sequence[str]] = None,
    order: str = "bottom_up",
    seed: int = 0,
    absolute: bool = True,
    init_std: float = 0.02,
    return_maps: bool = False,
) -> RandomizationResult:
    """Smooth MPRT (Hedström et al. 2023): the randomisation test on explanations denoised by sampling.

    The explanation of every model state is the mean over ``samples`` noisy copies of the input,
    ``(1/N) sum_i explain_fn(m, x + eps_i)`` with ``eps_i ~ N(0, sigma^2)`` and
    ``sigma = noise * (max(x) - min(x))`` per image (the paper's ImageNet setting: N = 50, 10 %).
    The same noise draws serve every model state, so the comparison sees the randomisation and not
    the sampling; each image's draws come from its own generator, seeded by its values and ``seed``
    (:mod:`vitexplain.metrics.seeding`), so a batch scores as its images one by one. Layers are then randomised cumulatively (:func:`randomization_check`, cascading), by
    default from the input side (``"bottom_up"``, which the paper recommends: top-down randomisation
    leaves the lower layers' information in the maps), and each state's denoised map is compared with
    the trained model's by Spearman rank correlation of the absolute values (Quantus's defaults).
    It must fall for a method that explains the model.

    Where Quantus 0.6 (``quantus.SmoothMPRT``) differs: it re-seeds every layer with the same seed,
    makes its last sample noise-free, draws new noise for every model state, and compares with the
    unsmoothed explanation when one is passed as ``a_batch``.

    Args:
        model: the model (left untouched: randomisation runs on a deep copy).
        explain_fn: ``(model, images) -> (B, h, w)`` maps; it receives each model state and a noisy copy
            of ``images``, e.g. ``lambda m, x: vx.Explainer(m).explain(x, method="cdam", target=t).maps``
            (fix the target explicitly).
        images: ``(B, C, H, W)`` preprocessed images.
        samples: noisy copies per explanation (N).
        noise: noise level as a fraction of each image's value range.
        layers: module names in randomisation order; default :func:`randomization_layers` in ``order``.
        order: ``"bottom_up"`` (input side first) or ``"top_down"`` (output side first, as Adebayo et
            al.); used only when ``layers`` is None.
        seed: seed of the noise and of the re-initialisation (layer ``k`` gets ``seed + k``).
        absolute: compare ``|maps|`` (Quantus's default for sMPRT).
        init_std: standard deviation for parameters no ``reset_parameters()`` covers.
        return_maps: also return the denoised maps of every step.

    Returns:
        :class:`RandomizationResult`: ``layers`` in randomisation order, ``correlations
        (len(layers), B)``, the denoised ``reference (B, h, w)`` and the ``maps`` of every step or None.
    """
    images = check_images(images)
    samples = check_positive_int(samples, "samples")
    seed = check_seed(seed)
    noise = real(noise, "noise (a fraction of each image's value range)")
    if noise < 0:
        raise UsageError(f"noise must be a finite fraction >= 0 of each image's value range, got {noise!r}")
    if order not in ("bottom_up", "top_down"):
        raise UsageError(f"order must be 'bottom_up' (input side first) or 'top_down', got {order!r}")
    names = _layer_names(model, layers)
    if layers is None and order == "bottom_up":
        names = names[::-1]
    flat = images.flatten(1)
    sigma = (noise * (flat.amax(1) - flat.amin(1))).view(-1, 1, 1, 1)

    def denoised(m: nn.Module) -> Tensor:
        generators = image_generators(images, seed)  # the same draws for every state; per image, by content
        total: Optional[Tensor] = None
        for i in range(samples):
            eps = per_image_draws(generators, images.shape[1:], "randn", images)
            maps = check_maps(explain_fn(m, images + sigma * eps), f"explain_fn output (sample {i})", batch=len(images))
            if total is not None and maps.shape != total.shape:
                raise UsageError(f"explain_fn returned maps of shape {tuple(maps.shape)}, then {tuple(total.shape)}")
            total = maps.to(exact_dtype(maps.device)) if total is None else total + maps.to(total)
        if total is None:  # (samples >= 1 is checked above)
            raise UsageError(f"samples must be at least 1, got {samples}")
        return (total / samples).float()

    return randomization_check(
        model, denoised, layers=names, mode="cascading", seed=seed, absolute=absolute, init_std=init_std,
        return_maps=return_maps,
    )
