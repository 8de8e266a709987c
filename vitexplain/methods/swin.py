"""Methods for Swin Transformers (family ``"swin"``): windowed attention and last-stage tokens.

Attention methods read every block's windows through :mod:`.windowed` (raw on any stage's
grid, rollout / gradient rollout / Chefer's rule through shifted windows and patch merging,
attention Grad-CAM); token methods (CDAM and variants, token Grad-CAM) work on the tokens
entering the last block's attention, on the last stage's grid; LeGrad on the last stage's
blocks; captum methods on the last stage's grid. Definitions: docs/methods.md, "Swin".

Token methods re-run the last block and the head with the attention input held as its own
leaf tensor (a scoped pre-hook on the last attention module), so dy/dT is the gradient along
the attention path also for V2 blocks, whose attention input is the residual stream itself.
Each call first checks that the re-run reproduces the model's outputs (``Context.partial``,
1e-4 relative).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from ..errors import UnsupportedMethodError, UnsupportedModelError
from . import captum_methods
from .context import Context
from .options import Option, check_index, check_head_or_fusion, check_indices, integrated_cdam_options, smooth_cdam_options
from .families import SWIN, VIT
from .registry import get, register
from ..targets import Target
from .tokens import _slice_score, cdam_scores, integrated_mean_grad, smooth_mean
from .windowed import WindowedLayer, propagate_windows, stage_vector, window_layers

__all__ = ["raw", "rollout", "grad_rollout", "generic", "attn_gradcam", "cdam", "gradcam",
           "cdam_smooth", "cdam_integrated", "legrad", "tokens_and_grad"]



def _geometry(ctx: Context) -> tuple[list[WindowedLayer], list[tuple[int, int]]]:
    return window_layers(ctx), ctx.adapter.stage_grids(tuple(ctx.x.shape[-2:]))


def _pick(ctx: Context, layers: list[WindowedLayer], layer: int) -> WindowedLayer:
    return layers[check_index(ctx.method, "layer", layer, len(layers), "blocks over all stages")]


def _stage(ctx: Context, grids: list[tuple[int, int]], stage: int) -> int:
    return check_index(ctx.method, "stage", stage, len(grids), "stages")


def _on_grid(values: Tensor, grid: tuple[int, int]) -> Tensor:
    return values.view(values.shape[0], *grid)


# -- attention ---------------------------------------------------------------------------
_FUSION = Option(str, choices=("mean", "max", "min"), help="how heads are fused")
_STAGE = Option(int, help="stage whose grid the map is on (0 = the patch grid; negative counts from the last)")
_DISCARD = Option(float, low=0, high=1, high_open=True, help="fraction of smallest same-window entries zeroed per block")


@register(
    "raw", SWIN, class_sensitive=False, requires=("grid", "attention", "readout"),
    options={
        "layer": Option(int, help="block index over all stages, negative counts from the last"),
        "head": Option(int, optional=True, help="one head, negative counts from the last (None = fuse heads)"),
        "head_fusion": _FUSION,
        "query": Option(int, optional=True, sequence=True,
                        help="None = mean over all query tokens; a token index or (row, col) on the block's stage grid"),
    },
    summary="raw windowed attention of one block on its stage grid (mean over queries, or one query token)",
    reference="Dosovitskiy et al. 2021 per window; docs/methods.md, Swin",
)
def raw(ctx: Context, *, layer: int = -1, head: Optional[int] = None, head_fusion: str = "mean",
        query: object = None) -> Tensor:
    """Raw attention of block ``layer``, assembled from its windows on its stage grid.

    ``map[j] = sum_i q_i A[i, j]`` with A the block's dense attention (windows placed on the
    grid, the cyclic shift undone, padding dropped) and q the readout: the mean over all
    query tokens (the model averages its tokens; each query only reaches its own window), or
    one query token.

    Args:
        ctx: the captured forward.
        layer: block index over all stages (negative counts from the last).
        head: one head, or None to fuse heads with ``head_fusion``.
        head_fusion: ``"mean"``, ``"max"`` or ``"min"``.
        query: None (mean over queries), a token index on the block's stage grid, or (row, col).

    Returns:
        (B, H_s, W_s) float32 on the block's stage grid.
    """
    layers, grids = _geometry(ctx)
    chosen = _pick(ctx, layers, layer)
    grid = grids[chosen.stage]
    check_head_or_fusion(ctx.method, head, head_fusion)
    if head is not None:
        head = check_index(ctx.method, "head", head, chosen.record.num_heads, "heads")
    vector = stage_vector(grid, ctx.batch_size, chosen.record.device, query)
    return _on_grid(chosen.vec_mat(vector, chosen.fused(head_fusion, head)), grid)


@register(
    "rollout", SWIN, class_sensitive=False, requires=("grid", "attention", "rollout", "readout"),
    options={"head_fusion": _FUSION, "discard_ratio": _DISCARD, "stage": _STAGE},
    # every window of every block is read, without gradients, through one head fusion: on CPU
    # the capture computes attention once and keeps only that fusion (materialize.py)
    dense_attention=True, reads_fused=lambda options: options["head_fusion"],
    summary="attention rollout through shifted windows and patch merging (mean readout), on a stage grid",
    reference="Abnar & Zuidema 2020 on Swin's dense windowed matrices; docs/methods.md, Swin",
)
def rollout(ctx: Context, *, head_fusion: str = "mean", discard_ratio: float = 0.0, stage: int = 0) -> Tensor:
    """Rollout of ``rownorm(0.5 fuse_h(A_l) + 0.5 I)`` over all blocks, merges distributing
    relevance to the 2 x 2 children, read out by the mean over the last stage's tokens.

    Args:
        ctx: the captured forward.
        head_fusion: ``"mean"``, ``"max"`` or ``"min"``.
        discard_ratio: per block and image, zero the smallest fraction of the entries that
            share a window before adding I.
        stage: the grid of the map (0 = the patch grid); blocks of earlier stages are left out.

    Returns:
        (B, H_s, W_s) float32; sums to 1 per image.
    """
    layers, grids = _geometry(ctx)
    stage = _stage(ctx, grids, stage)
    out = propagate_windows(layers, grids, lambda l: l.fused(head_fusion), mode="rollout",
                            to_stage=stage, discard_ratio=discard_ratio)
    return _on_grid(out, grids[stage])


def _grad_weighted(layer: WindowedLayer) -> Tensor:
    """clamp(mean_h(A * dy/dA), 0) per window: (B, nW, n, n)."""
    return (layer.probs() * layer.grad_probs()).mean(dim=2).clamp(min=0)


def _chefer(layer: WindowedLayer) -> Tensor:
    """mean_h(clamp(dy/dA * A, 0)) per window: (B, nW, n, n)."""
    return (layer.grad_probs() * layer.probs()).clamp(min=0).mean(dim=2)


@register(
    "grad_rollout", SWIN, grads=True, requires=("grid", "attention", "rollout", "readout"),
    options={"discard_ratio": _DISCARD, "stage": _STAGE},
    summary="gradient rollout through shifted windows and patch merging, on a stage grid",
    reference="vit-explain (fixed) on Swin's dense windowed matrices; docs/methods.md, Swin",
)
def grad_rollout(ctx: Context, *, discard_ratio: float = 0.0, stage: int = 0) -> Tensor:
    """As ``rollout`` with ``fused = clamp(mean_h(A * dy/dA), 0)`` per block, read as
    ``u (R - R_identity)`` like ``generic`` (docs/methods.md, Swin).

    Returns:
        (B, H_s, W_s) float32.
    """
    layers, grids = _geometry(ctx)
    stage = _stage(ctx, grids, stage)
    out = propagate_windows(layers, grids, _grad_weighted, mode="rollout", to_stage=stage,
                            discard_ratio=discard_ratio, deviation=True)
    return _on_grid(out, grids[stage])


@register(
    "generic", SWIN, grads=True, requires=("grid", "attention", "rollout", "readout"), options={"stage": _STAGE},
    summary="Chefer's rule through shifted windows and patch merging (identity path removed), on a stage grid",
    reference="Chefer, Gur & Wolf, ICCV 2021 on Swin's dense windowed matrices; docs/methods.md, Swin",
)
def generic(ctx: Context, *, stage: int = 0) -> Tensor:
    """``R = R + mean_h(clamp(dy/dA_l * A_l, 0)) @ R`` over all blocks (merges distributing
    to the children), mean readout, minus the readout of the identity path.

    Returns:
        (B, H_s, W_s) float32, non-negative.
    """
    layers, grids = _geometry(ctx)
    stage = _stage(ctx, grids, stage)
    return _on_grid(propagate_windows(layers, grids, _chefer, mode="generic", to_stage=stage, deviation=True),
                    grids[stage])


@register(
    "attn_gradcam", SWIN, grads=True, requires=("grid", "attention", "readout"),
    options={"layer": Option(int, help="block index over all stages, negative counts from the last")},
    summary="attention Grad-CAM on one block's windowed attention (mean readout), on its stage grid",
    reference="Chefer et al. 2021 baseline, mean readout; docs/methods.md, Swin",
)
def attn_gradcam(ctx: Context, *, layer: int = -1) -> Tensor:
    """Per head h: ``a_h = q @ A_h``, ``g_h = q @ dy/dA_h`` (q the mean readout),
    ``w_h = mean_j g_h[j]``; map ``clamp(mean_h(w_h a_h), 0)``.

    Returns:
        (B, H_s, W_s) float32 on the block's stage grid.
    """
    layers, grids = _geometry(ctx)
    chosen = _pick(ctx, layers, layer)
    grid = grids[chosen.stage]
    vector = stage_vector(grid, ctx.batch_size, chosen.record.device)
    probs, grads = chosen.probs(), chosen.grad_probs()
    heads = probs.shape[2]
    attn = torch.stack([chosen.vec_mat(vector, probs[:, :, h]) for h in range(heads)], dim=1)
    grad = torch.stack([chosen.vec_mat(vector, grads[:, :, h]) for h in range(heads)], dim=1)
    cam = (grad.mean(dim=-1, keepdim=True) * attn).mean(dim=1).clamp(min=0)
    return _on_grid(cam, grid)


# -- last-stage tokens ---------------------------------------------------------------------
def _last_block(adapter) -> list[str]:
    return [adapter.blocks[-1]]


@contextlib.contextmanager
def _attention_input(ctx: Context, replace: Optional[Tensor] = None) -> Iterator[list[Tensor]]:
    """Scoped pre-hook on the last attention module: its input becomes a leaf tensor.

    The leaf is the module's own input, detached (``replace=None``), or ``replace``
    (B, H, W, C) laid out as the module expects (windows or grid); gradients w.r.t. it
    follow the attention path only.
    """
    adapter = ctx.adapter
    module = ctx.model_module(adapter.swin_blocks[-1].attention)
    geometry = adapter.geometry(len(adapter.blocks) - 1, _grids(ctx)[-1])
    seen: list[Tensor] = []

    def hook(mod: nn.Module, args: tuple) -> tuple:
        source = args[0]
        if replace is not None:
            source = geometry.partition(replace) if adapter.windowed_input else replace
            if source.shape != args[0].shape:
                raise UnsupportedModelError(
                    f"the last attention module received {tuple(args[0].shape)}, not the expected {tuple(source.shape)}"
                )
        leaf = source.detach().requires_grad_(True)
        seen.append(leaf)
        return (leaf, *args[1:])

    handle = module.register_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _grids(ctx: Context) -> list[tuple[int, int]]:
    return ctx.adapter.stage_grids(tuple(ctx.x.shape[-2:]))


def _tail(ctx: Context, x: Tensor, replace: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Last block + head on block input ``x`` (model layout), attention input as a leaf.

    Returns:
        (outputs (b, K), the leaf in the attention module's layout).
    """
    adapter = ctx.adapter
    grid = _grids(ctx)[-1]
    with torch.enable_grad(), _attention_input(ctx, replace) as seen:
        out = adapter.run_block(-1, x, grid)
        logits = adapter.head(adapter.to_grid(out, grid))
    if len(seen) != 1:
        raise UnsupportedModelError(f"the last block called its attention module {len(seen)} times, expected once")
    return logits, seen[0]


def _to_grid(ctx: Context, leaf: Tensor) -> Tensor:
    """The attention module's input layout (windows or grid) -> (B, H, W, C)."""
    adapter = ctx.adapter
    if not adapter.windowed_input:
        return leaf
    return adapter.geometry(len(adapter.blocks) - 1, _grids(ctx)[-1]).unpartition(leaf)


def _block_input(ctx: Context) -> Tensor:
    return ctx.recorder.activation(ctx.adapter.blocks[-1]).input.detach()


def _check_tail(ctx: Context) -> None:
    """Check once per call that re-running the last block and the head reproduces the model."""
    ctx.partial("tail", lambda x: _tail(ctx, x)[0].detach(), _block_input(ctx))


def tokens_and_grad(ctx: Context) -> tuple[Tensor, Tensor]:
    """T, the tokens entering the last block's attention, and dy/dT along the attention path.

    Re-runs the last block and the head (checked first against the model's own outputs).

    Returns:
        (T, dy/dT), each (B, H, W, C) float32 on the last stage's grid.
    """
    _check_tail(ctx)
    logits, leaf = _tail(ctx, _block_input(ctx))
    (grad,) = torch.autograd.grad(ctx.score(logits).sum(), leaf)
    return _to_grid(ctx, leaf.detach()).float(), _to_grid(ctx, grad).float()


@register(
    "cdam", SWIN, activations=_last_block, signed=True, requires=("grid", "tokens", "tail"),
    summary="CDAM on the tokens entering the last block's attention, last stage grid (signed)",
    reference="Brocki, Binda & Chung 2023; docs/methods.md, Swin",
)
def cdam(ctx: Context) -> Tensor:
    """CDAM ``S_i = sum_d T_id dy/dT_id``, T the last attention's input tokens (signed).

    Returns:
        (B, H_L, W_L) float32.
    """
    tokens, grad = tokens_and_grad(ctx)
    return (tokens * grad).sum(dim=-1)


@register(
    "gradcam", SWIN, activations=_last_block, requires=("grid", "tokens", "tail"),
    summary="token Grad-CAM on the tokens entering the last block's attention, last stage grid",
    reference="Selvaraju et al. 2017 on Swin tokens; docs/methods.md, Swin",
)
def gradcam(ctx: Context) -> Tensor:
    """``ReLU(sum_d w_d T_d)`` with ``w_d`` the grid mean of dy/dT_d.

    Returns:
        (B, H_L, W_L) float32, non-negative.
    """
    tokens, grad = tokens_and_grad(ctx)
    weights = grad.mean(dim=(1, 2), keepdim=True)
    return torch.relu((tokens * weights).sum(dim=-1))


@register(
    "cdam_smooth", SWIN, activations=_last_block, signed=True, requires=("grid", "tokens", "tail"),
    options=smooth_cdam_options("the last block input"),
    summary="smooth CDAM: mean CDAM over noisy copies of the last Swin block's input",
    reference="Brocki, Binda & Chung 2023 (Smooth CDAM); docs/methods.md, Swin",
)
def cdam_smooth(ctx: Context, *, samples: int = 50, noise: float = 0.05, batch_size: int = 64,
                seed: Optional[int] = 0) -> Tensor:
    """Mean CDAM over ``samples`` copies of the last block's input with Gaussian noise of
    standard deviation ``noise * (max - min)`` per image (one shared noise draw).

    Returns:
        (B, H_L, W_L) float32, signed.
    """
    _check_tail(ctx)

    def score_rows(rows: Tensor, target: Target, part: slice) -> Tensor:
        logits, leaf = _tail(ctx, rows)
        (grad,) = torch.autograd.grad(_slice_score(target, logits, part).sum(), leaf)
        return cdam_scores(_to_grid(ctx, leaf.detach()), _to_grid(ctx, grad))

    return smooth_mean(_block_input(ctx), ctx.target, samples=samples, noise=noise, batch_size=batch_size, seed=seed,
                       score_rows=score_rows)


@register(
    "cdam_integrated", SWIN, activations=_last_block, signed=True, requires=("grid", "tokens", "tail"),
    options=integrated_cdam_options(),
    summary="integrated CDAM on the tokens entering the last block's attention (completeness)",
    reference="Brocki, Binda & Chung 2023 (Integrated CDAM); docs/methods.md, Swin",
)
def cdam_integrated(ctx: Context, *, steps: int = 32, batch_size: int = 64) -> Tensor:
    """``S_i = sum_d T_id mean_k dy/dT_id(alpha_k T)``, straight path from T' = 0, residual
    held at the block input, midpoint rule; ``sum_i S_i ~ y(T) - y(0)``.

    Returns:
        (B, H_L, W_L) float32, signed.
    """
    tokens, _ = tokens_and_grad(ctx)
    x = _block_input(ctx)

    def grad_rows(residual: Tensor, point: Tensor, target: Target, part: slice) -> Tensor:
        logits, leaf = _tail(ctx, residual, replace=point.to(x.dtype))
        (grad,) = torch.autograd.grad(_slice_score(target, logits, part).sum(), leaf)
        return _to_grid(ctx, grad).float()

    mean_grad = integrated_mean_grad(tokens, x, ctx.target, steps=steps, batch_size=batch_size, grad_rows=grad_rows)
    return (tokens * mean_grad).sum(dim=-1)


def _last_stage_blocks(adapter) -> list[str]:
    return [adapter.blocks[i] for i in adapter.stage_blocks(-1)]


@register(
    "legrad", SWIN, grads=True, activations=_last_stage_blocks, retain_graph=True,
    requires=("grid", "attention", "head"),
    options={"layers": Option(int, optional=True, sequence=True, help="block indices (None = the last stage's blocks)")},
    summary="LeGrad on the last stage's blocks (the head reads only last-stage tokens)",
    reference="Bousselham et al. 2024; docs/methods.md, Swin",
)
def legrad(ctx: Context, *, layers: Optional[Sequence[int]] = None) -> Tensor:
    """LeGrad over the last stage's blocks: ``s_l`` = the head on block l's output tokens,
    ``E_l[j] = mean over heads and all query tokens of ReLU(d s_l / d A_l)[i, j]`` (dense
    windowed matrix), map = mean_l E_l, min-max normalised.

    Args:
        ctx: the captured forward (gradients enabled).
        layers: block indices over all stages (negative from the last); default: the last
            stage's blocks. Earlier stages' tokens have another width than the head reads.

    Returns:
        (B, H_L, W_L) float32 in [0, 1].
    """
    adapter = ctx.adapter
    all_layers, grids = _geometry(ctx)
    allowed = adapter.stage_blocks(-1)
    chosen = allowed if layers is None else check_indices(ctx.method, "layers", layers, len(all_layers),
                                                          "blocks over all stages")
    outside = [i for i in chosen if i not in allowed]
    if outside:
        raise UnsupportedMethodError(
            f"legrad applies the head to a block's output tokens, which only the last stage's blocks "
            f"{allowed} have in the head's width; blocks {outside} are in earlier stages. Use "
            "'generic' or 'grad_rollout' for relevance through all stages"
        )
    grid = grids[-1]
    head = ctx.head()  # checked on the last block's tokens first
    total = torch.zeros(ctx.batch_size, grid[0] * grid[1], device=ctx.x.device)
    with torch.enable_grad():
        for i in chosen:
            layer = all_layers[i]
            outputs = head(ctx.recorder.activation(adapter.blocks[i]).output)
            (d_out,) = torch.autograd.grad(ctx.score(outputs).sum(), layer.record.output, retain_graph=True)
            relu = torch.relu(layer.grad_probs(d_out)).sum(dim=(2, 3))  # (B, nW, n) over heads, queries
            total += layer.from_windows(relu) / (layer.record.num_heads * layer.num_tokens)
    maps = total / len(chosen)
    low, high = maps.amin(1, keepdim=True), maps.amax(1, keepdim=True)
    return _on_grid((maps - low) / (high - low).clamp(min=1e-12), grid)


# captum methods need only a grid: the last stage's
for _fn in (captum_methods.integrated_gradients, captum_methods.occlusion, captum_methods.smoothgrad):
    _spec = get(_fn.__name__, VIT)
    register(_spec.name, SWIN, attention=False, signed=_spec.signed, options=_spec.options, requires=_spec.requires,
             summary=f"{_spec.summary} (last stage grid)", reference=_spec.reference)(_fn)
