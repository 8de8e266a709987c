"""AttnLRP and CP-LRP per caption word: relevance of each word's logit at the pixels, through the
decoder's cross-attention and the image encoder.

One teacher-forced forward of the captioner under :class:`~vitexplain.methods.lrp_rules.LRPRules`
(its self- and cross-attention get the attention rule, norms and activations theirs), then one
backward per word (the graph kept between them): word t's score is the logit of the explained
token t at position t (LRP explains a logit, not a log-probability: the log-softmax over the
vocabulary is not a rule-covered operation). Maps (B, T, H, W) at pixel resolution, or summed per
patch of the encoder's grid with ``resolution="patches"``. Rules and sources: docs/methods.md.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from .context import CaptionContext
from .families import CAPTION
from .lrp import DEFAULT_GAMMA, _OPTIONS
from .lrp_coverage import check_coverage, checkpointing_refused
from .lrp_rules import LRPRules
from .registry import register

__all__ = ["caption_lrp"]


def caption_lrp(ctx: CaptionContext, variant: str, resolution: str, linear_gamma: float, conv_gamma: float) -> Tensor:
    """Per-word pixel relevance of a captioner under the LRP rules.

    Args:
        ctx: the explained captions (``ids`` (B, T), the input ``x``).
        variant: ``"attnlrp"`` or ``"cp"``.
        resolution: ``"pixels"`` or ``"patches"``.
        linear_gamma, conv_gamma: Gamma rule gammas (0 = off).

    Returns:
        (B, T, H, W) relevance (or (B, T, gh, gw) summed per patch), signed.

    Raises:
        UnsupportedModelError: the decoder or encoder holds a non-linearity the rules do not cover.
    """
    adapter = ctx.adapter
    x = ctx.x.detach().clone().requires_grad_(True)
    rules = LRPRules(variant, linear_gamma=linear_gamma, conv_gamma=conv_gamma, model=adapter.model)
    ids = ctx.ids
    with torch.enable_grad():
        runs = getattr(adapter, "model_runs", None)  # (errors inside transformers as UnsupportedModelErrors)
        with rules, runs() if callable(runs) else nullcontext():
            logits = adapter.teacher_forced(x, ids)
        check_coverage(rules, ctx.method, type(adapter.model).__name__, instead="'cross_generic'")
        scores = logits.gather(2, ids[..., None].to(logits.device))[..., 0]  # (B, T)
        words = scores.shape[1]
        maps = []
        for t in range(words):
            with checkpointing_refused(ctx.method, type(adapter.model).__name__):
                (grad,) = torch.autograd.grad(scores[:, t].sum(), x, retain_graph=t < words - 1)
            maps.append((x.detach() * grad).float().sum(dim=1))
    pixels = torch.stack(maps, dim=1)  # (B, T, H, W)
    if resolution == "pixels":
        return pixels
    return ctx.layout.sum_cells(pixels)  # (B, T, gh, gw): each patch's own pixels


_COMMON = dict(options=_OPTIONS, attention=False, signed=True, requires=("cross", "lrp"))


@register("attnlrp", CAPTION, **_COMMON,
          summary="AttnLRP per word: relevance of each word's logit at the pixels, through cross-attention",
          reference="Achtibat et al., AttnLRP, ICML 2024; docs/methods.md")
def caption_attnlrp(ctx: CaptionContext, *, resolution: str = "pixels", linear_gamma: float = DEFAULT_GAMMA,
                    conv_gamma: float = DEFAULT_GAMMA) -> Tensor:
    """AttnLRP per caption word (see :func:`caption_lrp`).

    Args:
        ctx: the explained captions.
        resolution: ``"pixels"`` (B, T, H, W) or ``"patches"`` (B, T, gh, gw).
        linear_gamma: Gamma rule on linear layers (0 = off).
        conv_gamma: Gamma rule on convolutions (0 = off).

    Returns:
        (B, T, H, W) signed relevance per word.
    """
    return caption_lrp(ctx, "attnlrp", resolution, linear_gamma, conv_gamma)


@register("cp_lrp", CAPTION, **_COMMON,
          summary="CP-LRP per word: relevance of each word's logit, attention weights held constant",
          reference="Ali et al., ICML 2022; docs/methods.md")
def caption_cp_lrp(ctx: CaptionContext, *, resolution: str = "pixels", linear_gamma: float = DEFAULT_GAMMA,
                   conv_gamma: float = DEFAULT_GAMMA) -> Tensor:
    """CP-LRP per caption word (see :func:`caption_lrp`).

    Args:
        ctx: the explained captions.
        resolution: ``"pixels"`` or ``"patches"``.
        linear_gamma: Gamma rule on linear layers (0 = off).
        conv_gamma: Gamma rule on convolutions (0 = off).

    Returns:
        (B, T, H, W) signed relevance per word.
    """
    return caption_lrp(ctx, "cp", resolution, linear_gamma, conv_gamma)
