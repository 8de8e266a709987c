"""Captum-backed attributions, pooled to the patch grid: Integrated Gradients, occlusion, SmoothGrad.

These call captum (they are not re-implemented) and sum pixel attributions over each patch,
so their maps share the (B, gh, gw) grid of the attention methods.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..errors import ConvergenceWarning, UnsupportedMethodError
from ..recording.flex import flex_configured
from ..targets import logits_of
from .context import Context
from .options import MAX_SAMPLES, SEED_RANGE, Option
from .families import VIT
from .grad_layout import contiguous_norm_grads
from .registry import register

__all__ = ["integrated_gradients", "occlusion", "smoothgrad", "COMPLETENESS_RTOL", "AUTO_STEPS"]


#: Largest completeness error |sum of attributions - (y(x) - y(baseline))| / |y(x) - y(baseline)| that passes
#: without a :class:`~vitexplain.errors.ConvergenceWarning`: Sundararajan et al. 2017 (Sec. 5) find 20-300 steps bring the sum
#: "within 5%" of the score difference and advise checking exactly this and adding steps when it fails.
COMPLETENESS_RTOL = 0.05


def _model(ctx: Context, inp: Tensor) -> Any:
    """The adapter's forward of ``inp``, BatchNorm's gradients made contiguous (:mod:`~vitexplain.methods.grad_layout`).

    Raises:
        UnsupportedMethodError: the model calls FlexAttention on the CPU, where it has no backward (torch raised
            a bare NotImplementedError), and ``inp`` requires grad.
    """
    if inp.requires_grad and inp.device.type == "cpu" and flex_configured(ctx.adapter.model):
        _refuse_flex(ctx)  # (before the forward: torch's failure inside the compiled FlexAttention left dynamo's cache
    try:                   # so that a later capture of a flex model failed, 'bool' object has no attribute 'type')
        with contiguous_norm_grads(ctx.adapter.model):  # (one-image BatchNorm backward: grad_layout.py)
            return ctx.adapter.forward(inp)
    except NotImplementedError as err:
        if "FlexAttention does not support backward on CPU" not in str(err):
            raise
        _refuse_flex(ctx, err)


def _refuse_flex(ctx: Context, err: Optional[BaseException] = None) -> None:
    raise UnsupportedMethodError(
        f"method {ctx.method!r} takes gradients of the model, which calls FlexAttention, and FlexAttention has "
        "no backward pass on CPU (torch: 'FlexAttention does not support backward on CPU'): run it on a CUDA "
        "device, or use a method without gradients (raw, rollout, occlusion)") from err


def _forward_and_target(ctx: Context) -> tuple[Callable[[Tensor], Tensor], Optional[list[int]]]:
    """captum's forward function and target: logits + class indices, or a custom score."""
    if ctx.target.custom:
        return (lambda inp: ctx.score(_model(ctx, inp))), None
    return (lambda inp: logits_of(_model(ctx, inp))), ctx.target.classes.tolist()


def _as_image(ctx: Context, index: int) -> Callable[[Tensor], Tensor]:
    """A custom target's (S,) scores of S copies of image ``index``, each scored standing at row
    ``index`` of the explained batch's outputs: a target that scores rows by position (e.g.
    ``similarity`` to one vector per image) then scores every copy as image ``index``'s, whatever S."""
    clean = ctx.outputs.detach() if isinstance(ctx.outputs, Tensor) else None
    if clean is None:
        raise UnsupportedMethodError(
            f"method {ctx.method!r} scores each image's copies with the target, but the model's outputs are a "
            f"{type(ctx.outputs).__name__}; explain one image at a time"
        )

    def forward(inp: Tensor) -> Tensor:
        out = _model(ctx, inp)
        rows = [torch.cat([clean[:index], out[s : s + 1], clean[index + 1 :]]) for s in range(out.shape[0])]
        return torch.stack([ctx.score(r)[index] for r in rows])

    return forward


def _to_grid(ctx: Context, attributions: Tensor) -> Tensor:
    """Sum (B, 3, H, W) pixel attributions over channels and over each patch's own pixels
    (``TokenLayout.sum_cells``: a padded input's last patches cover fewer pixels): (B, gh, gw)."""
    return ctx.require_grid().sum_cells(attributions.float().sum(dim=1))


def _patch_mask(ctx: Context) -> Tensor:
    """(1, 1, H, W) long: the index of the patch each pixel belongs to (``TokenLayout.pixel_cells``)."""
    h, w = ctx.x.shape[-2:]
    return ctx.require_grid().pixel_cells((h, w), ctx.x.device).view(1, 1, h, w)


#: The automatic step counts (``steps=None``, the default): every image is integrated with the first; an image whose
#: completeness error is still over :data:`COMPLETENESS_RTOL` is integrated again, alone or with the other images
#: still over, with the next (twice as many points), up to the last, the cap. Sundararajan et al. 2017 (Sec. 5) find
#: 20-300 steps enough; an image still over at the cap gets the :class:`~vitexplain.errors.ConvergenceWarning`.
AUTO_STEPS = (32, 64, 128, 256)


@register(
    "integrated_gradients", VIT,
    options={
        "steps": Option(int, low=1, high=MAX_SAMPLES, optional=True,
                        help=f"integration steps (None = per image, {AUTO_STEPS[0]} doubled while the completeness "
                             f"error is over {COMPLETENESS_RTOL:g}, at most {AUTO_STEPS[-1]})"),
        "batch_size": Option(int, low=1, help="inputs per forward"),
        "baseline": Option(float, help="baseline input value"),
    },
    attention=False,
    requires=("grid", "pixels"),
    signed=True,
    summary="captum IntegratedGradients from a zero (mean-colour) baseline, summed per patch",
    reference="Sundararajan et al. 2017 (captum.attr.IntegratedGradients)",
)
def integrated_gradients(ctx: Context, *, steps: Optional[int] = None, batch_size: int = 64, baseline: float = 0.0
                         ) -> tuple[Tensor, dict[str, Any]]:
    """Integrated Gradients (captum) on the input pixels, summed over channels and patches.

    Checks how well the integral converged: by completeness (Sundararajan et al. 2017, Prop. 1) an image's
    attributions sum to y(x) - y(baseline); ``extras["completeness_error"]`` is how far the quadrature's sum is
    from it, relative to it. With ``steps=None`` (the default) each image gets the fewest of :data:`AUTO_STEPS`
    that bring it within :data:`COMPLETENESS_RTOL` (the paper's check and remedy: add steps): all start at 32,
    and only the images still over are integrated again with twice the steps, by themselves, so an image's map
    and step count never depend on the other images of its batch. A given ``steps`` integrates every image once
    with that many. A :class:`~vitexplain.errors.ConvergenceWarning` (one per call) names the images still over
    :data:`COMPLETENESS_RTOL` at the steps they got (with ``steps=None``: at the cap).

    Args:
        ctx: the explained batch.
        steps: integration steps (Gauss-Legendre points), or None to choose them per image as above.
        batch_size: captum's ``internal_batch_size``.
        baseline: constant baseline in the model's input space (0 = the mean colour for
            normalised inputs).

    Returns:
        (maps, extras): maps (B, gh, gw) float32, signed, summing to about y(x) - y(baseline); extras, each (B,):
        ``score_change`` y(x) - y(baseline) of the explained score, ``delta`` the sum of the pixel attributions
        minus ``score_change`` (captum's ``return_convergence_delta``), ``completeness_error`` |delta| /
        |score_change| (0 when both are 0, inf when only the change is), all float64, and ``steps`` (int64) the
        steps each image's map was integrated with.

    Raises:
        UnsupportedMethodError: the score changes only before the first integration point of the steps an image
            is integrated with (see :func:`_refuse_a_jump_before_the_first_point`).

    Warns:
        ConvergenceWarning: some image's completeness error is over :data:`COMPLETENESS_RTOL` at its last steps.
    """
    from captum.attr import IntegratedGradients

    forward, target = _forward_and_target(ctx)
    x = ctx.x.detach()
    scores = _score_fn(forward, target)
    with torch.no_grad():
        end = scores(x)
        change = end - scores(torch.full_like(x, baseline))
    # (captum's attributions of a half / bfloat16 input are float32; a float64 model's keep their precision)
    attr = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32))
    delta = torch.zeros_like(change)
    used = torch.zeros(x.shape[0], dtype=torch.long)
    todo = list(range(x.shape[0]))  # the images integrated with the next step count
    for n in AUTO_STEPS if steps is None else (steps,):
        rows = torch.tensor(todo, device=x.device)
        some = x if len(todo) == x.shape[0] else x[rows]  # (the whole batch: as it was explained)
        some_target = None if target is None else [target[i] for i in todo]
        at = rows.to(change.device)
        _refuse_a_jump_before_the_first_point(_score_fn(forward, some_target), some, end[at], change[at], baseline, n,
                                              todo)
        got = IntegratedGradients(forward).attribute(
            some, baselines=baseline, target=some_target, n_steps=n, internal_batch_size=batch_size
        )
        attr[rows] = got
        delta[at] = got.detach().double().flatten(1).sum(1).to(change.device) - change[at]
        used[rows.cpu()] = n
        over = (_errors(delta[at], change[at]) > COMPLETENESS_RTOL).tolist()
        todo = [i for i, again in zip(todo, over) if again]  # (each image by its own error only)
        if not todo:
            break
    error = _errors(delta, change)
    _warn_unconverged(error, used, auto=steps is None)
    return _to_grid(ctx, attr), {"score_change": change, "delta": delta, "completeness_error": error, "steps": used}


def _score_fn(forward: Callable[[Tensor], Tensor], target: Optional[list[int]]) -> Callable[[Tensor], Tensor]:
    """(k,) float64 explained scores of k inputs: ``forward``'s, or its logits at ``target`` (one class per input)."""

    def scores(inp: Tensor) -> Tensor:
        out = forward(inp).double()
        return out if target is None else out[torch.arange(out.shape[0], device=out.device), target]

    return scores


def _errors(delta: Tensor, change: Tensor) -> Tensor:
    """(B,) float64 completeness errors |delta| / |change|: 0 where both are 0, inf where only the change is."""
    error = delta.abs() / change.abs()
    return torch.where(change == 0, torch.where(delta == 0, 0.0, float("inf")).to(error), error)


def _warn_unconverged(error: Tensor, steps: Tensor, *, auto: bool) -> None:
    """One :class:`~vitexplain.errors.ConvergenceWarning` naming the images whose (B,) completeness ``error`` is over
    :data:`COMPLETENESS_RTOL` at the (B,) ``steps`` they were integrated with (``auto``: chosen by ``steps=None``,
    so those images reached the cap, :data:`AUTO_STEPS`' last)."""
    bad = (error > COMPLETENESS_RTOL).nonzero().flatten().tolist()
    if not bad:
        return
    worst = ", ".join(f"{i}: {float(error[i]):.3g}" for i in bad[:8]) + (", ..." if len(bad) > 8 else "")
    most = int(steps[bad].max())
    if auto:
        how = (f"with steps=None (automatic: {AUTO_STEPS[0]} steps, doubled per image while over "
               f"{COMPLETENESS_RTOL:g}) reached its cap of {AUTO_STEPS[-1]} steps")
    else:
        how = f"with steps={most}"
    warnings.warn(
        f"integrated_gradients {how}: for image(s) {bad} the attributions' sum misses "
        f"y(x) - y(baseline) by more than {COMPLETENESS_RTOL:g} of it (relative completeness error {worst}): the "
        "integral has not converged as far as Sundararajan et al. check for, and where the error is near or over 1 "
        "the map may mean little; pass more steps (e.g. "
        f"steps={min(4 * most, MAX_SAMPLES)}) and check e.extras['completeness_error']",
        ConvergenceWarning, stacklevel=3,
    )


#: How close to the image's score (relative to the whole change y(x) - y(baseline)) the score at IG's first
#: integration point may be before the change counts as lying before that point (refused).
FLAT_RTOL = 1e-2


def _refuse_a_jump_before_the_first_point(scores: Callable[[Tensor], Tensor], x: Tensor, end: Tensor, change: Tensor,
                                          baseline: float, steps: int, images: list[int]) -> None:
    """Refuse IG when the target score changes only between the baseline and the first integration point.

    captum integrates with Gauss-Legendre points alpha_1 < ... < alpha_m in (0, 1). When the score at
    ``baseline + alpha_1 (x - baseline)`` is already the image's (within :data:`FLAT_RTOL` of the change
    y(x) - y(baseline)), no point sees the change: the attributions sum to ~0 instead of y(x) - y(baseline)
    and the map is rounding noise. A model that normalises each patch's token right after a bias-free
    patch embedding (AIMv2: a convolution, then RMSNorm) does this from the zero baseline: scaling a patch's
    pixels leaves its token unchanged, so its score moves only within about sqrt(eps) of the baseline.
    Checked for the ``steps`` the images are about to be integrated with; costs one forward of them without
    gradients.

    Args:
        scores: (k,) float64 explained scores of k inputs (:func:`_score_fn`).
        x: (k, 3, H, W) the images.
        end: (k,) float64 their scores y(x).
        change: (k,) float64 y(x) - y(baseline).
        baseline: the baseline value.
        steps: the integration steps.
        images: the k images' positions in the explained batch (for the message).

    Raises:
        UnsupportedMethodError: for some image the change lies before the first point.
    """
    import numpy as np

    first = float((np.polynomial.legendre.leggauss(steps)[0].min() + 1) / 2)  # captum's default rule
    start = torch.full_like(x, baseline)
    with torch.no_grad():
        gap = (scores(start + first * (x - start)) - end).abs()
    size = change.abs()
    flat = (size > 0) & (gap <= FLAT_RTOL * size)
    if bool(flat.any()):
        named = [images[i] for i in flat.nonzero().flatten().tolist()]
        raise UnsupportedMethodError(
            f"integrated_gradients with steps={steps} from baseline={baseline:g}: for image(s) {named} the target score "
            f"at the first integration point ({first:.3g} of the way from the baseline) is already the image's (within "
            f"{FLAT_RTOL:g} of y(x) - y(baseline)), so the whole change happens before it, no point sees it, and every "
            "patch would get ~0 (rounding noise). A model whose patch embedding has no bias and is normalised per token "
            "(e.g. AIMv2: scaling a patch's pixels leaves its token unchanged) does this from the zero baseline. Pass "
            "another baseline (for such a model a non-zero one, e.g. baseline=0.5) or more steps, or use 'occlusion' or "
            "'smoothgrad'"
        )


@register(
    "occlusion", VIT,
    options={
        "baseline": Option(float, help="value an occluded patch is replaced with"),
        "batch_size": Option(int, low=1, help="inputs per forward"),
    },
    attention=False,
    requires=("grid", "pixels"),
    signed=True,
    summary="captum FeatureAblation over the patch grid: score drop when a patch is replaced",
    reference="Zeiler & Fergus 2014 (captum.attr.FeatureAblation with a patch feature mask)",
)
def occlusion(ctx: Context, *, baseline: float = 0.0, batch_size: int = 16) -> Tensor:
    """Occlusion on the patch grid (captum FeatureAblation): for each patch, the drop of the
    target score when the patch is replaced by ``baseline``.

    Args:
        ctx: the explained batch.
        baseline: replacement value in the model's input space (0 = mean colour).
        batch_size: ablated copies per forward (captum's ``perturbations_per_eval``; at most the
            number of patches).

    Returns:
        (B, gh, gw) float32, signed (positive: the patch supports the target).
    """
    from captum.attr import FeatureAblation

    forward, target = _forward_and_target(ctx)
    mask = _patch_mask(ctx)
    layout = ctx.require_grid()
    # captum stacks perturbations_per_eval copies of the input whether or not there are that many
    # patches to occlude: more than the grid's patches is all of them (2**40 was a MemoryError)
    per_eval = min(batch_size, layout.grid[0] * layout.grid[1])
    attr = FeatureAblation(forward).attribute(
        ctx.x.detach(), baselines=baseline, target=target, feature_mask=mask, perturbations_per_eval=per_eval
    )
    # every pixel of a patch carries that patch's value: its mean over the patch's pixels is that value
    return layout.sum_cells(attr[:, 0].float()) / layout.sum_cells(torch.ones_like(attr[:1, 0], dtype=torch.float32))


@register(
    "smoothgrad", VIT,
    options={
        "samples": Option(int, low=1, high=MAX_SAMPLES, help="noisy samples"),
        "noise": Option(float, low=0, help="noise std relative to each image's value range"),
        "batch_size": Option(int, low=1, help="inputs per forward"),
        "seed": Option(int, low=SEED_RANGE[0], high=SEED_RANGE[1], optional=True,
                       help="noise seed (None = the global RNG)"),
    },
    attention=False,
    requires=("grid", "pixels"),
    summary="captum NoiseTunnel(Saliency) SmoothGrad, |gradient| summed per patch",
    reference="Smilkov et al. 2017 (captum.attr.NoiseTunnel + Saliency)",
)
def smoothgrad(ctx: Context, *, samples: int = 16, noise: float = 0.15, batch_size: int = 32,
               seed: Optional[int] = 0) -> Tensor:
    """SmoothGrad (captum): mean absolute input gradient over noisy copies, per patch.

    Each image gets its own captum call with noise of standard deviation ``noise * (max -
    min)`` of that image, drawn after seeding the RNG with ``seed`` (the global RNG state is
    restored afterwards), so a batch gives the same maps as its images one by one.

    Args:
        ctx: the explained batch.
        samples: noisy samples per image.
        noise: noise standard deviation relative to each image's value range.
        batch_size: captum's ``nt_samples_batch_size``.
        seed: noise seed; None draws from the global RNG (maps then vary between calls).

    Returns:
        (B, gh, gw) float32, non-negative.
    """
    from captum.attr import NoiseTunnel, Saliency

    model_forward, target = _forward_and_target(ctx)
    x = ctx.x.detach()
    maps = []
    for i in range(x.shape[0]):
        image_forward = _as_image(ctx, i) if ctx.target.custom and x.shape[0] > 1 else model_forward

        def forward(noisy: Tensor, image_forward: Callable[[Tensor], Tensor] = image_forward) -> Tensor:
            return image_forward(noisy.to(x.dtype))  # captum draws float32 noise: a bf16/fp16 image became float32

        tunnel = NoiseTunnel(Saliency(forward))
        image = x[i : i + 1]
        stdev = float(noise * (image.max() - image.min()))
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else [], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            attr = tunnel.attribute(
                image, nt_type="smoothgrad", nt_samples=samples, stdevs=stdev,
                target=None if target is None else target[i : i + 1], nt_samples_batch_size=batch_size,
            )
        maps.append(_to_grid(ctx, attr))
    return torch.cat(maps)
