"""Gradient-on-token maps at the last attention's input: CDAM (+ smooth, integrated), token Grad-CAM.

T is the output of the adapter's ``norm1`` (the last block's first norm): the tokens entering
the final attention, (B, N, D). The capture records T and dy/dT; smooth and integrated CDAM
re-run only the last block and the head (``ctx.tail()``, checked against the model's own
outputs first), batched over samples.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from .context import Context
from .options import integrated_cdam_options, smooth_cdam_options
from .families import VIT
from .registry import register
from ..checks import differentiable
from ..errors import CaptureError
from ..targets import Target

__all__ = ["cdam", "cdam_smooth", "cdam_integrated", "gradcam", "cdam_scores", "smooth_mean", "integrated_mean_grad"]


def _last_tokens(adapter) -> list[str]:
    return [adapter.norm1, adapter.blocks[-1]]


def _tokens_and_grad(ctx: Context) -> tuple[Tensor, Tensor]:
    act = ctx.recorder.activation(ctx.adapter.norm1)
    if act.grad is None:
        raise CaptureError(f"no gradient reached {ctx.adapter.norm1!r}; the target score does not depend on it")
    return act.output.detach(), act.grad


def cdam_scores(tokens: Tensor, grad: Tensor) -> Tensor:
    """CDAM relevance per token: ``S_i = sum_d T_id * dy/dT_id``.

    Args:
        tokens: (B, N, D) tokens T.
        grad: (B, N, D) dy/dT.

    Returns:
        (B, N) float32, signed.
    """
    return (tokens.float() * grad.float()).sum(dim=-1)


@register(
    "cdam", VIT,
    grads=True,
    requires=("grid", "tokens"),
    activations=_last_tokens,
    signed=True,
    summary="class-discriminative attention map: sum_d T * dy/dT at the last attention's input (signed)",
    reference="Brocki, Binda & Chung 2023; docs/methods.md",
)
def cdam(ctx: Context) -> Tensor:
    """CDAM: per patch token i, ``S_i = sum_d T_id * dy/dT_id``; signed, not clamped.

    Positive values are evidence for the target, negative against it; overlay with
    ``normalize="signed"`` (a diverging colormap centred at zero).

    Returns:
        (B, gh, gw) float32.
    """
    layout = ctx.require_grid()
    tokens, grad = _tokens_and_grad(ctx)
    return layout.to_grid(cdam_scores(tokens, grad))


@register(
    "gradcam", VIT,
    grads=True,
    requires=("grid", "tokens"),
    activations=_last_tokens,
    summary="token Grad-CAM on the last block's first-norm output (pytorch-grad-cam style)",
    reference="Selvaraju et al. 2017, applied to ViT tokens as pytorch-grad-cam does; docs/methods.md",
)
def gradcam(ctx: Context) -> Tensor:
    """Token Grad-CAM: X = patch tokens of T as a (D, gh, gw) image,
    ``w_d = mean over the grid of dy/dX_d``, map ``ReLU(sum_d w_d X_d)``.

    The input side of the last attention is used because the last block's output patch
    tokens get zero gradient when the head reads only the class token.

    Returns:
        (B, gh, gw) float32, non-negative.
    """
    layout = ctx.require_grid()
    tokens, grad = _tokens_and_grad(ctx)
    x, g = tokens[:, layout.patch_slice].float(), grad[:, layout.patch_slice].float()
    weights = g.mean(dim=1, keepdim=True)  # (B, 1, D)
    return layout.to_grid(torch.relu((x * weights).sum(dim=-1)))


@contextlib.contextmanager
def _norm1_output(module: nn.Module, replace: Optional[Tensor] = None) -> Iterator[list[Tensor]]:
    """Scoped hook on the last block's first norm: records (or replaces) its output."""
    seen: list[Tensor] = []

    def hook(mod: nn.Module, args: tuple, output: Tensor) -> Optional[Tensor]:
        if replace is not None:
            seen.append(replace)
            return replace
        seen.append(output)
        return None

    handle = module.register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _chunks(total: int, size: int) -> Iterator[slice]:
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))



RowFn = Callable[[Tensor, Target, slice], Tensor]
"""``fn(rows, target, part) -> per-row results`` on rows ``part`` of an image-major batch of copies."""


def smooth_mean(x: Tensor, target: Target, *, samples: int, noise: float, batch_size: int, seed: Optional[int],
                score_rows: RowFn) -> Tensor:
    """The mean over ``samples`` noisy copies of ``x`` of ``score_rows``, per image.

    Copy s of every image gets the same standard-normal draw, scaled by that image's range
    (``noise * (max - min)``), so a batch gives the same result as its images one by one. The
    noise is drawn ``batch_size`` samples at a time and the copies run ``batch_size`` rows per
    forward: memory does not grow with ``samples``.

    Args:
        x: (B, ...) what is perturbed (e.g. the last block's input).
        target: the explained target (repeated per copy for class targets).
        samples, noise, batch_size, seed: the method's options.
        score_rows: per-row scores of a chunk of noisy rows (image-major copies).

    Returns:
        (B, ...) the mean of the per-row results over the samples.
    """
    b = x.shape[0]
    flat = x.flatten(1)
    sigma = (noise * (flat.amax(1) - flat.amin(1))).view(b, *([1] * x.dim()))
    generator = torch.Generator(device=x.device).manual_seed(seed) if seed is not None else None
    total: Any = 0.0  # becomes a (B, ...) tensor at the first group (samples >= 1)
    for group in _chunks(samples, batch_size):
        n = group.stop - group.start
        eps = torch.randn(n, *x.shape[1:], device=x.device, dtype=x.dtype, generator=generator)
        noisy = (x.unsqueeze(1) + sigma * eps.unsqueeze(0)).flatten(0, 1)  # (B * n, ...), image-major
        rows_target = target.repeat(n)
        out = torch.cat([score_rows(noisy[part], rows_target, part) for part in _chunks(noisy.shape[0], batch_size)])
        part_sum = out.view(b, n, *out.shape[1:]).sum(dim=1)
        total = total + part_sum
    return total / samples


def integrated_mean_grad(tokens: Tensor, residual: Tensor, target: Target, *, steps: int, batch_size: int,
                         grad_rows: Callable[[Tensor, Tensor, Target, slice], Tensor]) -> Tensor:
    """``mean_k dy/dT(alpha_k T)`` over the midpoint path from T' = 0 to T, per image.

    Args:
        tokens: (B, ...) T.
        residual: (B, ...) what the re-run part also takes, held fixed along the path.
        target: the explained target.
        steps: integration points m (midpoint rule); ``batch_size`` points at a time.
        grad_rows: ``grad_rows(residual_rows, point_rows, target, part) -> dy/dT`` of rows
            ``part`` of an image-major batch of path points.

    Returns:
        (B, ...) the mean gradient, shaped like the per-row gradients.
    """
    b = tokens.shape[0]
    alphas = (torch.arange(steps, device=tokens.device, dtype=tokens.dtype) + 0.5) / steps
    total: Any = 0.0  # becomes a (B, ...) tensor at the first group (steps >= 1)
    for group in _chunks(steps, batch_size):
        n = group.stop - group.start
        path = (alphas[group].view(1, n, *([1] * (tokens.dim() - 1))) * tokens.unsqueeze(1)).flatten(0, 1)
        held = residual.unsqueeze(1).expand(b, n, *residual.shape[1:]).flatten(0, 1)
        rows_target = target.repeat(n)
        out = torch.cat([grad_rows(held[part], path[part], rows_target, part) for part in _chunks(b * n, batch_size)])
        part_sum = out.view(b, n, *out.shape[1:]).sum(dim=1)
        total = total + part_sum
    return total / steps


@register(
    "cdam_smooth", VIT,
    options=smooth_cdam_options("the last block input"),
    grads=True,
    requires=("grid", "tokens", "tail"),
    activations=_last_tokens,
    signed=True,
    summary="smooth CDAM: mean CDAM over noisy copies of the last block's input",
    reference="Brocki, Binda & Chung 2023 (Smooth CDAM); docs/methods.md",
)
def cdam_smooth(ctx: Context, *, samples: int = 50, noise: float = 0.05, batch_size: int = 64, seed: Optional[int] = 0) -> Tensor:
    """Smooth CDAM: the mean of CDAM over ``samples`` copies of the last block's input with
    Gaussian noise of standard deviation ``noise * (max - min)`` (per image) added.

    Only the last block and the head are re-run, ``batch_size`` copies at a time.

    Args:
        ctx: the captured forward.
        samples: number of noisy samples (paper: 50).
        noise: noise level relative to the value range of the last block's input.
        batch_size: copies per re-run of the last block.
        seed: seed of the noise (None: the global RNG). The same (samples, N, D) draw of
            standard-normal noise is used for every image, scaled by its own range.

    Returns:
        (B, gh, gw) float32, signed.
    """
    layout = ctx.require_grid()
    adapter = ctx.adapter
    tail = ctx.tail()
    norm1 = ctx.model_module(adapter.norm1)

    def score_rows(rows: Tensor, target: Target, part: slice) -> Tensor:
        with torch.enable_grad(), _norm1_output(norm1) as seen:
            logits = tail(rows.detach().requires_grad_(True))  # a graph also when every weight is frozen
        tokens = seen[0]
        (grad,) = torch.autograd.grad(_slice_score(target, logits, part).sum(), tokens)
        return cdam_scores(tokens.detach(), grad)

    x = ctx.recorder.activation(adapter.norm1).input.detach()
    scores = smooth_mean(x, ctx.target, samples=samples, noise=noise, batch_size=batch_size, seed=seed,
                         score_rows=score_rows)
    return layout.to_grid(scores)


def _slice_score(target, logits: Tensor, part: slice) -> Tensor:
    """Scores of rows ``part`` of a repeated batch (class targets) or of any rows (callables)."""
    if target.custom:
        return differentiable(target.score(logits))
    from ..targets import class_score

    return class_score(target.classes[part])(logits)


@register(
    "cdam_integrated", VIT,
    options=integrated_cdam_options(),
    grads=True,
    requires=("grid", "tokens", "tail"),
    activations=_last_tokens,
    signed=True,
    summary="integrated CDAM: integrated gradients on the last attention's input tokens",
    reference="Brocki, Binda & Chung 2023 (Integrated CDAM); docs/methods.md",
)
def cdam_integrated(ctx: Context, *, steps: int = 32, batch_size: int = 64) -> Tensor:
    """Integrated CDAM: ``S_i = sum_d (T_id - T'_id) * mean_k dy/dT_id(T_k)``.

    The path runs straight from the baseline T' = 0 to T in the space of the tokens that
    enter the final attention (the last block's first-norm output), with the residual
    stream of the last block held at its actual input, so ``sum_i S_i`` approximates
    ``y(T) - y(T' = 0)`` (completeness). The integral uses the midpoint rule with
    ``steps`` points; only the last block and the head are re-run.

    Args:
        ctx: the captured forward.
        steps: integration points m.
        batch_size: path points per re-run of the last block.

    Returns:
        (B, gh, gw) float32, signed. Scores over all tokens (prefix included) are
        available from :func:`integrated_token_scores`.
    """
    layout = ctx.require_grid()
    return layout.to_grid(integrated_token_scores(ctx, steps=steps, batch_size=batch_size))


def integrated_token_scores(ctx: Context, *, steps: int = 32, batch_size: int = 64) -> Tensor:
    """Integrated CDAM scores for every token (prefix included): (B, N) float32."""
    adapter = ctx.adapter
    tail = ctx.tail()
    tokens = ctx.recorder.activation(adapter.norm1).output.detach()
    x = ctx.recorder.activation(adapter.norm1).input.detach()
    norm1 = ctx.model_module(adapter.norm1)

    def grad_rows(residual: Tensor, point: Tensor, target: Target, part: slice) -> Tensor:
        point = point.detach().clone().requires_grad_(True)
        with torch.enable_grad(), _norm1_output(norm1, replace=point):
            logits = tail(residual)
        (grad,) = torch.autograd.grad(_slice_score(target, logits, part).sum(), point)
        return grad

    mean_grad = integrated_mean_grad(tokens, x, ctx.target, steps=steps, batch_size=batch_size, grad_rows=grad_rows)
    return cdam_scores(tokens, mean_grad)
