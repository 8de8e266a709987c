"""Smooth and integrated CDAM for hierarchical and pooling transformers (family ``"hier"``), on the last stage.

Both re-run the block that holds the last stage's token site (T, the tokens entering its last attention:
``adapter.token_sites[-1]``) and the model's head (``adapter.head_on``), from the block's recorded input
(``adapter.tail_block`` and ``adapter.tail_run``: TNT re-runs its last block's outer half from ``norm_out``'s input),
with T as a leaf (a scoped forward hook on the site module); each call first checks that this re-run
gives the model's outputs (``Context.partial``, 1e-4 relative). Definitions: docs/methods.md,
"Hierarchical transformers".
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ..targets import Target
from .context import Context
from .families import HIER
from .options import integrated_cdam_options, smooth_cdam_options
from .registry import register
from .tokens import _slice_score, cdam_scores, integrated_mean_grad, smooth_mean

__all__ = ["cdam_smooth", "cdam_integrated", "tail"]


def _modules(adapter) -> list[str]:
    block = adapter.tail_block()
    return list(dict.fromkeys([block, adapter.token_sites[-1]])) if block else []  # TNT: the block is the site


def tail(ctx: Context, x: Tensor, replace: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The last block (from input ``x``, its other arguments as recorded) and the head, T held as a leaf.

    Args:
        ctx: the captured forward.
        x: (b, ...) block input rows (the recorded input's layout); where T is the block's input itself
            (``adapter.tail_input_is_t()``: LeViT) the leaf is ``x``.
        replace: T itself (the site's layout), or None: the site's own output (LeViT: ``x``), detached.

    Returns:
        (outputs (b, K), the leaf T in the site's layout).

    Raises:
        UnsupportedModelError: the site did not run once, or ``replace`` has another shape than its output.
    """
    adapter = ctx.adapter
    name = adapter.tail_block()
    block, site = ctx.model_module(name), ctx.model_module(adapter.token_sites[-1])
    recorded = ctx.recorder.activation(name)
    if adapter.tail_input_is_t():  # LeViT: T is the block's input itself (and its residual): the leaf is x
        source = x if replace is None else replace
        if source.shape != x.shape:
            raise UnsupportedModelError(f"T of shape {tuple(source.shape)} for block inputs {tuple(x.shape)}")
        leaf = source.detach().requires_grad_(True)
        with torch.enable_grad():
            return adapter.head_on(adapter.head_layout(name, adapter.tail_run(block, leaf, recorded))), leaf
    seen: list[Tensor] = []

    def hook(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
        source = output if replace is None else replace
        if source.shape != output.shape:
            raise UnsupportedModelError(f"{adapter.token_sites[-1]!r} gave {tuple(output.shape)}, not the expected "
                                        f"{tuple(source.shape)}")
        leaf = source.detach().requires_grad_(True)
        seen.append(leaf)
        return leaf

    handle = site.register_forward_hook(hook)
    try:
        with torch.enable_grad():
            tokens = adapter.tail_run(block, x, recorded)
            logits = adapter.head_on(adapter.head_layout(name, tokens))
    finally:
        handle.remove()
    if len(seen) != 1:
        raise UnsupportedModelError(f"{adapter.token_sites[-1]!r} ran {len(seen)} times in its block, expected once")
    return logits, seen[0]


def _block_input(ctx: Context) -> Tensor:
    return ctx.recorder.activation(ctx.adapter.tail_block()).input.detach()


def _check(ctx: Context) -> None:
    ctx.partial("tail", lambda x: tail(ctx, x)[0].detach(), _block_input(ctx))


def _grid(ctx: Context, site_tokens: Tensor) -> Tensor:
    """Site-layout tokens (b, ...) -> (b, H_L, W_L, C) on the last stage's grid."""
    sites = ctx.adapter.token_sites
    return ctx.adapter.site_grid(len(sites) - 1, site_tokens, tuple(ctx.x.shape[-2:]))


_REQUIRES = ("grid", "tokens", "head", "tail")


@register(
    "cdam_smooth", HIER, activations=_modules, signed=True, requires=_REQUIRES,
    options=smooth_cdam_options("the last block input"),
    summary="smooth CDAM: mean CDAM over noisy copies of the last stage's last block input (last stage grid)",
    reference="Brocki, Binda & Chung 2023 (Smooth CDAM); docs/methods.md, Hierarchical transformers",
)
def cdam_smooth(ctx: Context, *, samples: int = 50, noise: float = 0.05, batch_size: int = 64,
                seed: Optional[int] = 0) -> Tensor:
    """Mean over ``samples`` copies of the last block's input with Gaussian noise of standard deviation
    ``noise * (max - min)`` per image of ``S_i = sum_d T_id dy/dT_id``, T the tokens entering that block's
    attention.

    Returns:
        (B, H_L, W_L) float32, signed.
    """
    x = _block_input(ctx)  # read from the explained forward before any re-run
    _check(ctx)

    def score_rows(rows: Tensor, target: Target, part: slice) -> Tensor:
        logits, leaf = tail(ctx, rows)
        (grad,) = torch.autograd.grad(_slice_score(target, logits, part).sum(), leaf)
        return cdam_scores(_grid(ctx, leaf.detach()), _grid(ctx, grad))

    return smooth_mean(x, ctx.target, samples=samples, noise=noise, batch_size=batch_size, seed=seed,
                       score_rows=score_rows)


@register(
    "cdam_integrated", HIER, activations=_modules, signed=True, requires=_REQUIRES,
    options=integrated_cdam_options(),
    summary="integrated CDAM on the tokens entering the last stage's last attention (completeness)",
    reference="Brocki, Binda & Chung 2023 (Integrated CDAM); docs/methods.md, Hierarchical transformers",
)
def cdam_integrated(ctx: Context, *, steps: int = 32, batch_size: int = 64) -> Tensor:
    """``S_i = sum_d T_id mean_k dy/dT_id(alpha_k T)``, straight path from T' = 0, the block input held (the
    residual), midpoint rule; ``sum_i S_i ~ y(T) - y(0)``.

    Returns:
        (B, H_L, W_L) float32, signed.
    """
    x = _block_input(ctx)  # read from the explained forward before any re-run
    tokens = ctx.recorder.activation(ctx.adapter.token_sites[-1]).output.detach()
    _check(ctx)
    per_image = _per_image(ctx, tokens)  # (B, k, ...): a site that lays out k windows per image (TinyViT)

    def grad_rows(residual: Tensor, point: Tensor, target: Target, part: slice) -> Tensor:
        logits, leaf = tail(ctx, residual, replace=point.flatten(0, 1).to(tokens.dtype))
        (grad,) = torch.autograd.grad(_slice_score(target, logits, part).sum(), leaf)
        return grad.float().view(point.shape)

    mean_grad = integrated_mean_grad(per_image.float(), x, ctx.target, steps=steps, batch_size=batch_size,
                                     grad_rows=grad_rows)
    return cdam_scores(_grid(ctx, tokens), _grid(ctx, mean_grad.flatten(0, 1)))


def _per_image(ctx: Context, tokens: Tensor) -> Tensor:
    """The site's output (B * k, ...) in its own layout, image-major (k windows per image; k = 1: (B, ...)), as
    (B, k, ...) rows per image.

    Raises:
        UnsupportedModelError: its first dimension is not a multiple of the batch.
    """
    b = ctx.batch_size
    if tokens.shape[0] % b:
        raise UnsupportedModelError(
            f"{ctx.adapter.token_sites[-1]!r} output {tuple(tokens.shape)} for {b} images: its first dimension is not "
            "the images times a number of windows, so its tokens cannot be scaled per image; use 'cdam'")
    return tokens.reshape(b, tokens.shape[0] // b, *tokens.shape[1:])
