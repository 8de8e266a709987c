"""AttnLRP and CP-LRP: layer-wise relevance propagation through attention, on the unchanged model.

One forward and one backward of the model under :class:`~vitexplain.methods.lrp_rules.LRPRules`
(a scoped torch function mode: the fused attention kernel runs forward and backward, nothing of
the model or of torch is patched); the relevance is Gradient x Input at the pixels, summed over
the colour channels. ``e.maps`` is that relevance at pixel resolution (B, H, W) (or, with
``resolution="patches"``, summed over each cell of the patch grid the other methods' maps are on,
(B, gh, gw)); ``e.extras`` holds both (``"pixels"``, ``"grid"``), the explained scores and the
conservation ratio (input relevance / score) per image.

Rules and sources: :mod:`vitexplain.methods.lrp_rules` and docs/methods.md ("AttnLRP and CP-LRP").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..checks import checked_score
from ..errors import UnsupportedMethodError
from .context import Context
from .families import SWIN, VIT
from .lrp_coverage import check_coverage, checkpointing_refused
from .lrp_rules import LRPRules
from .options import Option
from .registry import register

__all__ = ["attnlrp", "cp_lrp", "lrp_relevance"]

#: Default gammas: 0, i.e. linears and convolutions as they are (the epsilon rule, what lxt's
#: efficient AttnLRP/CP-LRP do without zennit). AttnLRP's ViT experiments add zennit Gamma rules
#: (lxt's ``examples/vit_torch.py`` sweeps conv gamma in {0.1, 0.25, 100} and linear gamma in
#: {0, 0.01, 0.05, 0.1, 1}); docs/benchmarks.md ("LRP conservation") reports what they change.
DEFAULT_GAMMA = 0.0

_OPTIONS = {
    "resolution": Option(str, choices=("pixels", "patches"), help="maps at pixel resolution or summed per patch"),
    "linear_gamma": Option(float, low=0, help="zennit Gamma rule's gamma on linear layers (0 = epsilon, as they are)"),
    "conv_gamma": Option(float, low=0, help="zennit Gamma rule's gamma on convolutions (0 = epsilon, as they are)"),
}


def lrp_relevance(ctx: Context, variant: str, *, linear_gamma: float = DEFAULT_GAMMA,
                  conv_gamma: float = DEFAULT_GAMMA, attention: bool = True) -> tuple[Tensor, Tensor]:
    """Pixel relevance of the explained targets under the LRP rules.

    When the Explainer's forward already ran under this method's rules (``ctx.shared``, the method
    alone in a call), its scores are differentiated; otherwise the model runs once more under them.

    Args:
        ctx: the explained batch (its input, target and adapter).
        variant: ``"attnlrp"`` or ``"cp"``.
        linear_gamma, conv_gamma: Gamma rule gammas (0 = off).
        attention: require the forward to hold attention (the methods do; a model without
            attention gets the rules on its linears, convolutions, norms and activations only).

    Returns:
        ((B, 3, H, W) relevance x * dscore/dx, (B,) the explained scores).

    Raises:
        UnsupportedModelError: the forward held a non-linearity the rules do not cover, or the model
            checkpoints its blocks (they are recomputed in the backward, outside the rules).
        TargetError: a custom target's score is detached from the model's outputs.
    """
    adapter = ctx.adapter
    if ctx.shared is not None and ctx.x.requires_grad:
        (rules, score), x = ctx.shared, ctx.x
    else:
        x = ctx.x.detach().clone().requires_grad_(True)
        rules = LRPRules(variant, linear_gamma=linear_gamma, conv_gamma=conv_gamma, model=adapter.model)
        with torch.enable_grad(), rules:
            score = ctx.score(adapter.forward(x))
    name = type(adapter.model).__name__
    check_coverage(rules, ctx.method, name, attention=attention)
    with torch.enable_grad(), checkpointing_refused(ctx.method, name):
        (grad,) = torch.autograd.grad(checked_score(score).sum(), x)
    return (x.detach() * grad).float(), score.detach().float()


def _rules(variant: str) -> Any:
    """The ``forward_rules`` of a variant: (options, model) -> a fresh :class:`LRPRules`."""
    def make(options: Any, model: Any = None) -> LRPRules:
        return LRPRules(variant, linear_gamma=options.get("linear_gamma", DEFAULT_GAMMA),
                        conv_gamma=options.get("conv_gamma", DEFAULT_GAMMA), model=model)

    return make


def _grid(ctx: Context, pixels: Tensor) -> Tensor:
    """(B, H, W) relevance summed over each cell of the maps' grid: (B, gh, gw)."""
    layout = ctx.layout
    if layout is None or layout.grid is None:
        raise UnsupportedMethodError(f"method {ctx.method!r} needs the model's patch grid to pool its maps")
    return layout.sum_cells(pixels)  # each patch's own pixels (a padded input's last patches: fewer)


def _explain(ctx: Context, variant: str, resolution: str, linear_gamma: float, conv_gamma: float) -> tuple[Tensor, dict[str, Any]]:
    relevance, score = lrp_relevance(ctx, variant, linear_gamma=linear_gamma, conv_gamma=conv_gamma)
    pixels = relevance.sum(dim=1)
    grid = _grid(ctx, pixels)
    total = pixels.flatten(1).sum(1)
    # a zero score has no ratio: NaN, not the relevance sum itself (what dividing by 1 there reported)
    extras = {"pixels": pixels, "grid": grid, "score": score,
              "conservation": torch.where(score == 0, torch.full_like(score, float("nan")), total / score)}
    return (pixels if resolution == "pixels" else grid), extras


_COMMON = dict(options=_OPTIONS, attention=False, signed=True, requires=("pixels", "lrp"))


@register(
    "attnlrp", VIT, **_COMMON, forward_rules=_rules("attnlrp"),
    summary="AttnLRP: LRP through attention (q, k, v gradients x 1/4, 1/4, 1/2), identity rule on norms and activations",
    reference="Achtibat et al., AttnLRP, ICML 2024 (lxt 2.1 efficient rules); docs/methods.md",
)
def attnlrp(ctx: Context, *, resolution: str = "pixels", linear_gamma: float = DEFAULT_GAMMA,
            conv_gamma: float = DEFAULT_GAMMA) -> tuple[Tensor, dict[str, Any]]:
    """AttnLRP (Achtibat et al. 2024) relevance at the pixels.

    One forward + backward under :class:`~vitexplain.methods.lrp_rules.LRPRules` ("attnlrp"):
    at every scaled_dot_product_attention the gradient is scaled by 1/4 at q and k and 1/2 at v
    (the fused kernel runs forward and backward); norms' standard deviations are detached;
    element-wise activations pass ``f(x)/x``; linears as they are, or zennit's Gamma rule.

    Args:
        ctx: the explained batch.
        resolution: ``"pixels"`` (B, H, W) or ``"patches"`` (summed per patch cell, (B, gh, gw)).
        linear_gamma: Gamma rule on linear layers (0 = off).
        conv_gamma: Gamma rule on convolutions (0 = off).

    Returns:
        (maps, extras): maps signed, summing to about the target score (conservation);
        extras ``pixels`` (B, H, W), ``grid`` (B, gh, gw), ``score`` (B,), ``conservation`` (B,) (relevance sum /
        score; NaN where the score is 0).
    """
    return _explain(ctx, "attnlrp", resolution, linear_gamma, conv_gamma)


@register(
    "cp_lrp", VIT, **_COMMON, forward_rules=_rules("cp"),
    summary="CP-LRP: LRP with attention weights held constant (q and k detached), identity rule on norms",
    reference="Ali et al., ICML 2022 (lxt 2.1 CP-LRP); docs/methods.md",
)
def cp_lrp(ctx: Context, *, resolution: str = "pixels", linear_gamma: float = DEFAULT_GAMMA,
           conv_gamma: float = DEFAULT_GAMMA) -> tuple[Tensor, dict[str, Any]]:
    """Conservative propagation LRP (Ali et al. 2022) relevance at the pixels.

    As :func:`attnlrp`, but at attention q and k are detached (relevance flows through the values
    only, with the attention weights as constants).

    Args:
        ctx: the explained batch.
        resolution: ``"pixels"`` or ``"patches"``.
        linear_gamma: Gamma rule on linear layers (0 = off).
        conv_gamma: Gamma rule on convolutions (0 = off).

    Returns:
        (maps, extras) as :func:`attnlrp`.
    """
    return _explain(ctx, "cp", resolution, linear_gamma, conv_gamma)


# the same functions for the windowed family (Swin's attention is SDPA with a mask)
register("attnlrp", SWIN, **_COMMON, forward_rules=_rules("attnlrp"), summary="AttnLRP (see the vit family)",
         reference="Achtibat et al., AttnLRP, ICML 2024; docs/methods.md")(attnlrp)
register("cp_lrp", SWIN, **_COMMON, forward_rules=_rules("cp"), summary="CP-LRP (see the vit family)",
         reference="Ali et al., ICML 2022; docs/methods.md")(cp_lrp)
