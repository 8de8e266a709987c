"""Methods for hierarchical and pooling transformers (family ``"hier"``).

The adapter describes the model as a chain of attention calls and token-set transitions
(:mod:`.resample`); the attention methods carry a readout row back through that chain by the
footprint rule (raw attention of one call, rollout, gradient rollout, Chefer's rule), onto the
grid of any stage (option ``stage``, 0 = the finest token grid). Token methods (CDAM, token
Grad-CAM) read the tokens entering the last attention call of a stage and their gradient,
recorded in the explained forward (``adapter.token_sites``), so nothing is re-run. The captum
methods attribute pixels, pooled to the finest grid. Definitions: docs/methods.md,
"Hierarchical transformers".
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..errors import CaptureError, UnsupportedMethodError
from . import captum_methods
from .context import Context
from .families import HIER, VIT
from .options import Option, check_index, check_head_or_fusion
from .registry import get, register
from .resample import Call, Item, bind, calls, propagate
from .tokens import cdam_scores

__all__ = ["raw", "rollout", "grad_rollout", "generic", "cdam", "gradcam", "chain_of", "stage_tokens", "pick_stage"]


def chain_of(ctx: Context) -> list[Item]:
    """The model's chain for this input, bound to the captured attention records."""
    spec = ctx.adapter.chain(tuple(ctx.x.shape[-2:]))
    return bind(spec, ctx.recorder.records, ctx.batch_size, ctx.method)


def _stages(ctx: Context) -> list:
    return ctx.adapter.stage_sets(tuple(ctx.x.shape[-2:]))


def pick_stage(ctx: Context, stage: int, count: int, usable: list[int], lacks: str) -> int:
    """``stage`` checked against the stages a method can show (``usable``, of ``count``).

    A non-negative ``stage`` is that stage, refused when the method cannot show it; a negative one
    counts from the last stage the method *can* show (so the default -1 is the deepest map there
    is: a model whose last stage is one block that pools its queries, as Hiera with one block per
    stage, gets the stage before, on that stage's grid, which ``e.layout`` states).

    Raises:
        OptionError: ``stage`` is outside ``[-len(usable), count)``.
        UnsupportedMethodError: a non-negative ``stage`` the method cannot show (``lacks`` says why).
    """
    if stage < 0 and usable:
        return usable[check_index(ctx.method, "stage", stage, len(usable), "stages where it applies")]
    stage = check_index(ctx.method, "stage", stage, count, "stages")
    if stage not in usable:
        raise UnsupportedMethodError(
            f"stage {stage} of {type(ctx.adapter.model).__name__} has {lacks}, so {ctx.method!r} has nothing to "
            f"show there; choose a stage in {usable} (a negative stage counts from the last of them)")
    return stage


def _attention_stage(ctx: Context, items: list[Item], stage: int) -> int:
    """``stage`` checked against the stages an attention row can be carried back to: those
    with an attention call on their own grid (a stage whose only block pools its queries
    has none; its map would be the readout alone). Negative: from the last such stage."""
    sets = _stages(ctx)
    chain_stage = ctx.adapter.chain_stage
    usable = sorted({s for s in range(len(sets)) if any(c.in_stage >= chain_stage(s) for c in calls(items))})
    return pick_stage(ctx, stage, len(sets), usable, "no attention call on its own grid")


def _start(ctx: Context, items: list[Item]) -> Tensor:
    last = items[-1]
    tokens = last.spec.out if isinstance(last, Call) else last.footprint.coarse
    return ctx.adapter.readout_row(tokens, ctx.batch_size, ctx.x.device)


def _carry(ctx: Context, matrix, *, mode: str, stage: int, discard_ratio: float = 0.0, deviation: bool = False,
           stochastic: bool = False, head_mean: bool = False):
    items = chain_of(ctx)
    stage = _attention_stage(ctx, items, stage)
    r = propagate(items, _start(ctx, items), matrix, mode=mode, to_stage=ctx.adapter.chain_stage(stage),
                  discard_ratio=discard_ratio, deviation=deviation, stochastic=stochastic, head_mean=head_mean)
    return ctx.adapter.finish(r, stage, tuple(ctx.x.shape[-2:]))


_FUSION = Option(str, choices=("mean", "max", "min"), help="how heads are fused")
_STAGE = Option(int, help="stage whose grid the map is on (0 = the patch grid; negative counts from the last "
                           "stage with an attention call on its own grid)")
_DISCARD = Option(float, low=0, high=1, high_open=True, help="fraction of smallest entries zeroed per call")


@register(
    "raw", HIER, class_sensitive=False, requires=("grid", "attention", "readout"),
    options={
        "layer": Option(int, help="attention call index over all stages, negative counts from the last"),
        "head": Option(int, optional=True, help="one head, negative counts from the last (None = fuse heads)"),
        "head_fusion": _FUSION,
    },
    summary="raw attention of one call, on its input grid through the keys' footprint (mean over its queries)",
    reference="Dosovitskiy et al. 2021 on resampled keys; docs/methods.md, Hierarchical transformers",
)
def raw(ctx: Context, *, layer: int = -1, head: Optional[int] = None, head_fusion: str = "mean") -> Tensor:
    """``map = q S_q^T A S_k D_k`` for call ``layer``: q the model's readout row restricted to
    the call's queries and renormalised (the mean over its query tokens, or the class token when
    the model reads one and the call has it; the mean over the call's queries when the readout
    has none of them, as a CrossViT fusion call's class token under an averaging head), placed on
    the grid of the call's input set.

    Returns:
        (B, H_I, W_I) float32 on the call's input grid.
    """
    chosen = calls(chain_of(ctx))
    call = chosen[check_index(ctx.method, "layer", layer, len(chosen), "attention calls over all stages")]
    check_head_or_fusion(ctx.method, head, head_fusion)
    if head is not None:
        head = check_index(ctx.method, "head", head, call.num_heads, "heads")
    q = ctx.adapter.readout_row(call.spec.out, ctx.batch_size, ctx.x.device)
    asked = torch.zeros_like(q)  # the readout restricted to this call's queries, renormalised
    slots = call.q_slots[call.q_slots >= 0]
    asked[:, slots] = q[:, slots]
    if not bool((asked.sum(dim=1) > 0).all()):  # the head reads none of its queries (a CrossViT fusion call's class
        asked[:, slots] = 1.0                   # token when the head averages the patches): the mean over them
    q = asked / asked.sum(dim=1, keepdim=True).clamp(min=1e-30)
    return ctx.adapter.finish_call(call.spec, call.vec_mat(q, call.fused(head_fusion, head)), tuple(ctx.x.shape[-2:]))


@register(
    "rollout", HIER, class_sensitive=False, requires=("grid", "attention", "rollout", "readout"),
    options={"head_fusion": _FUSION, "discard_ratio": _DISCARD, "stage": _STAGE},
    # every call is read whole and no gradient is taken: on CPU the capture computes attention
    # once (materialize.py). Every head is kept: a call may fold heads into its batch (SAM) or
    # hold windows where heads are (Hiera), so the fusion is taken per window here, not there.
    dense_attention=True,
    summary="attention rollout through every token resampling (footprint rule), on a stage grid",
    reference="Abnar & Zuidema 2020 with resampling footprints; docs/methods.md, Hierarchical transformers",
)
def rollout(ctx: Context, *, head_fusion: str = "mean", discard_ratio: float = 0.0, stage: int = 0) -> Tensor:
    """Rollout of ``rownorm(0.5 M_l + 0.5 D_q,l)`` over every call, transitions pulled through
    their footprints, read from the model's readout row.

    Returns:
        (B, H_s, W_s) float32; sums to (at most) 1 per image.
    """
    return _carry(ctx, lambda c: c.fused(head_fusion), mode="rollout", stage=stage, discard_ratio=discard_ratio,
                  stochastic=head_fusion == "mean", head_mean=head_fusion == "mean")  # a head mean of softmax rows: rows of 1


def _head_mean(x: Tensor) -> Tensor:
    """(B, G, H, n_q, n_k) -> (B, G, n_q, n_k), the mean over heads (one head: a view, not a copy)."""
    return x.squeeze(2) if x.shape[2] == 1 else x.mean(dim=2)


def _grad_weighted(call: Call) -> Tensor:
    return _head_mean(call.probs() * call.grad_probs()).clamp_(min=0)  # a fresh product: clamped in place


def _chefer(call: Call) -> Tensor:
    return _head_mean((call.grad_probs() * call.probs()).clamp_(min=0))


@register(
    "grad_rollout", HIER, grads=True, requires=("grid", "attention", "rollout", "readout"),
    options={"discard_ratio": _DISCARD, "stage": _STAGE},
    summary="gradient rollout through every token resampling, on a stage grid",
    reference="vit-explain (fixed) with resampling footprints; docs/methods.md, Hierarchical transformers",
)
def grad_rollout(ctx: Context, *, discard_ratio: float = 0.0, stage: int = 0) -> Tensor:
    """As ``rollout`` with ``clamp(mean_h(A * dy/dA), 0)``, read as ``u (R - R_identity)``.

    Returns:
        (B, H_s, W_s) float32.
    """
    return _carry(ctx, _grad_weighted, mode="rollout", stage=stage, discard_ratio=discard_ratio, deviation=True)


@register(
    "generic", HIER, grads=True, requires=("grid", "attention", "rollout", "readout"), options={"stage": _STAGE},
    summary="Chefer's rule through every token resampling (identity path removed), on a stage grid",
    reference="Chefer, Gur & Wolf, ICCV 2021 with resampling footprints; docs/methods.md, Hierarchical transformers",
)
def generic(ctx: Context, *, stage: int = 0) -> Tensor:
    """``r <- r D_q + r mean_h(clamp(dy/dA * A, 0)) S_k D_k`` over every call, minus the
    readout of the identity path.

    Returns:
        (B, H_s, W_s) float32, non-negative.
    """
    return _carry(ctx, _chefer, mode="generic", stage=stage, deviation=True)


# -- tokens at a stage -----------------------------------------------------------------------
def _sites(adapter) -> list[str]:
    return [s for s in adapter.token_sites if s]


def stage_tokens(ctx: Context, stage: int) -> tuple[Tensor, Tensor]:
    """T, the tokens entering the last attention call of ``stage``, and dy/dT, from the
    explained forward (the site's output and its recorded gradient).

    Returns:
        (T, dy/dT), each (B, H_s, W_s, C) float32 on the stage's grid.

    Raises:
        UnsupportedMethodError: the stage has no attention call with a spatial grid.
    """
    sites = ctx.adapter.token_sites
    stage = pick_stage(ctx, stage, len(sites), [i for i, s in enumerate(sites) if s],
                       "no attention call over a token grid")
    act = ctx.recorder.activation(sites[stage])
    if act.grad is None:
        raise CaptureError(f"no gradient reached {sites[stage]!r}; the target score does not depend on it")
    size = tuple(ctx.x.shape[-2:])
    tokens = ctx.adapter.site_grid(stage, act.output.detach(), size)
    grad = ctx.adapter.site_grid(stage, act.grad, size)
    return tokens.float(), grad.float()


_TOKEN_STAGE = Option(int, help="stage whose grid the map is on (0 = the patch grid; negative counts from the last "
                                 "stage with an attention call on its own grid)")


@register(
    "cdam", HIER, grads=True, activations=_sites, signed=True, requires=("grid", "tokens"),
    options={"stage": _TOKEN_STAGE},
    summary="CDAM on the tokens entering a stage's last attention (default: the last stage; signed)",
    reference="Brocki, Binda & Chung 2023; docs/methods.md, Hierarchical transformers",
)
def cdam(ctx: Context, *, stage: int = -1) -> Tensor:
    """``S_i = sum_d T_id dy/dT_id`` on the grid of ``stage``.

    Returns:
        (B, H_s, W_s) float32, signed.
    """
    tokens, grad = stage_tokens(ctx, stage)
    return cdam_scores(tokens, grad)


@register(
    "gradcam", HIER, grads=True, activations=_sites, requires=("grid", "tokens"),
    options={"stage": _TOKEN_STAGE},
    summary="token Grad-CAM on the tokens entering a stage's last attention (default: the last stage)",
    reference="Selvaraju et al. 2017 on stage tokens; docs/methods.md, Hierarchical transformers",
)
def gradcam(ctx: Context, *, stage: int = -1) -> Tensor:
    """``ReLU(sum_d w_d T_d)``, ``w_d`` the grid mean of dy/dT_d.

    Returns:
        (B, H_s, W_s) float32, non-negative.
    """
    tokens, grad = stage_tokens(ctx, stage)
    weights = grad.mean(dim=(1, 2), keepdim=True)
    return torch.relu((tokens * weights).sum(dim=-1))


# captum methods need only the finest grid (the layout's)
for _fn in (captum_methods.integrated_gradients, captum_methods.occlusion, captum_methods.smoothgrad):
    _spec = get(_fn.__name__, VIT)
    register(_spec.name, HIER, attention=False, signed=_spec.signed, options=_spec.options, requires=_spec.requires,
             summary=f"{_spec.summary} (finest grid)", reference=_spec.reference)(_fn)
