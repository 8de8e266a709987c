"""AttnLRP and CP-LRP per answer word of a decoder-only vision-language model, on the unchanged (fused) model.

One teacher-forced forward of prompt + answer under :class:`~vitexplain.methods.lrp_rules.LRPRules`
(the language model's and the vision tower's SDPA get the attention rule, LayerNorm / RMSNorm their
standard deviation held constant, SiLU / GELU the identity rule, a gated MLP's ``act(gate) * up`` the
uniform rule of a product of two activations, the rotary embedding's products with cos / sin stay
linear: cos and sin are constants of the positions), then one backward per answer word of the logit of
that word at the row that predicts it (LRP explains a logit, not a log-probability). The relevance
is ``x * dlogit/dx`` at the processor's pixels, summed over the colour channels; the adapter sums each
image token's pixels (:meth:`~vitexplain.adapters.vlm.base.VLMAdapter.lrp_tokens`) and the flow places
the tokens on the image as for the other VLM methods. Rules and sources: docs/methods.md ("AttnLRP and
CP-LRP", "Vision-language models").
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import UnsupportedMethodError
from .families import VLM
from .lrp import DEFAULT_GAMMA
from .lrp_coverage import check_coverage, checkpointing_refused
from .lrp_rules import LRPRules
from .options import Option
from .registry import register
from .vlm_context import VLMContext

__all__ = ["vlm_lrp", "vlm_attnlrp", "vlm_cp_lrp"]

_OPTIONS = {
    "linear_gamma": Option(float, low=0, help="zennit Gamma rule's gamma on linear layers (0 = epsilon, as they are)"),
    "conv_gamma": Option(float, low=0, help="zennit Gamma rule's gamma on convolutions (0 = epsilon, as they are)"),
}


def vlm_lrp(ctx: VLMContext, variant: str, linear_gamma: float = DEFAULT_GAMMA,
            conv_gamma: float = DEFAULT_GAMMA) -> list[Tensor]:
    """Per-word LRP relevance of each image token.

    Args:
        ctx: the explained batch (``inputs``: the teacher-forced forward's keyword arguments; ``ids`` (B, T),
            ``lengths`` (B,), ``start``, ``columns``).
        variant: ``"attnlrp"`` or ``"cp"``.
        linear_gamma, conv_gamma: Gamma rule gammas (0 = off).

    Returns:
        Per image b, (T, n_b) float32 signed relevance of its image tokens (0 for words past its answer).

    Raises:
        UnsupportedMethodError: the flow gave no teacher-forced inputs.
        UnsupportedModelError: the forward held a non-linearity the rules do not cover, or checkpointed blocks.
    """
    if ctx.inputs is None:
        raise UnsupportedMethodError(f"{ctx.method} runs the teacher-forced forward again under the LRP rules and "
                                     "needs its inputs; call it through Explainer.explain_caption")
    adapter = ctx.adapter
    name = type(adapter.model).__name__
    kwargs = dict(ctx.inputs)
    key = adapter.lrp_pixels(kwargs)
    x = kwargs[key].detach().clone().requires_grad_(True)  # (B, C, H, W) the processor's pixels (Qwen: (P, C*t*p*p);
    kwargs[key] = x                                        # tiles: (B, P, C, H, W))
    channels = x.dim() - 3 if x.dim() >= 4 else 1  # the colour axis (Qwen's rows: all of a patch's values)
    rules = LRPRules(variant, linear_gamma=linear_gamma, conv_gamma=conv_gamma, model=adapter.model)
    words = ctx.num_words
    with torch.enable_grad():
        with rules, adapter.model_reads_batch():
            logits = adapter.forward_logits(kwargs)  # (B, N, V)
        check_coverage(rules, ctx.method, name, instead="'cross_generic' or 'cross_grad'")
        rows = logits[:, ctx.start - 1: ctx.start - 1 + words]  # (B, T, V): row start-1+t predicts word t
        scores = rows.gather(2, ctx.ids[..., None].to(rows.device))[..., 0]  # (B, T) the words' logits
        present = ctx.lengths.to(scores.device)[:, None] > torch.arange(words, device=scores.device)
        scores = torch.where(present, scores, torch.zeros_like(scores))
        maps = []
        for t in range(words):
            with checkpointing_refused(ctx.method, name):
                (grad,) = torch.autograd.grad(scores[:, t].sum(), x, retain_graph=t < words - 1)
            maps.append((x.detach() * grad).float().sum(dim=channels))  # (B, H, W): channels summed
    relevance = torch.stack(maps, dim=1)  # (B, T, H, W) (Qwen's flattened patches: (P, T); tiles: (B, T, P, H, W))
    return adapter.lrp_tokens(relevance, [len(c) for c in ctx.columns], kwargs)


_COMMON = dict(options=_OPTIONS, attention=False, signed=True, requires=("image_attention", "lrp"))


@register("attnlrp", VLM, **_COMMON,
          summary="AttnLRP per word: relevance of each word's logit at the pixels, summed per image token",
          reference="Achtibat et al., AttnLRP, ICML 2024; docs/methods.md")
def vlm_attnlrp(ctx: VLMContext, *, linear_gamma: float = DEFAULT_GAMMA,
                conv_gamma: float = DEFAULT_GAMMA) -> list[Tensor]:
    """AttnLRP per answer word (see :func:`vlm_lrp`): q, k, v gradients x 1/4, 1/4, 1/2 at every attention.

    Args:
        ctx: the explained batch.
        linear_gamma: Gamma rule on linear layers (0 = off).
        conv_gamma: Gamma rule on convolutions (0 = off).

    Returns:
        Per image b, (T, n_b) float32 signed relevance.
    """
    return vlm_lrp(ctx, "attnlrp", linear_gamma, conv_gamma)


@register("cp_lrp", VLM, **_COMMON,
          summary="CP-LRP per word: relevance of each word's logit, attention weights held constant",
          reference="Ali et al., ICML 2022; docs/methods.md")
def vlm_cp_lrp(ctx: VLMContext, *, linear_gamma: float = DEFAULT_GAMMA,
               conv_gamma: float = DEFAULT_GAMMA) -> list[Tensor]:
    """CP-LRP per answer word (see :func:`vlm_lrp`): q and k detached at every attention.

    Args:
        ctx: the explained batch.
        linear_gamma: Gamma rule on linear layers (0 = off).
        conv_gamma: Gamma rule on convolutions (0 = off).

    Returns:
        Per image b, (T, n_b) float32 signed relevance.
    """
    return vlm_lrp(ctx, "cp", linear_gamma, conv_gamma)
