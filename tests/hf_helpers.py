"""Shared by the Hugging Face tests: sharper attention for tiny random models, and an eager oracle."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import Tensor, nn

_QUERY_KEY = ("q_proj.weight", "k_proj.weight", "query.weight", "key.weight")


def perturb_norms(model: nn.Module, generator: torch.Generator) -> None:
    """LayerNorm gains and biases drawn away from the identity (random-init gradients through Swin's norms are
    otherwise near zero), in place, from ``generator``."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm) and module.weight is not None:
                module.weight.normal_(1.0, 0.2, generator=generator)
                module.bias.normal_(0.0, 0.2, generator=generator)


def sharpen_attention(model: nn.Module, factor: float = 3.0) -> None:
    """Scale every query and key projection in place: sharper attention than a random init gives."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_QUERY_KEY):
                p.mul_(factor)


def eager_oracle(
    model: nn.Module, image: Tensor, score_fn: Callable[[Any], Tensor], norm1: str
) -> tuple[list[Tensor], list[Tensor], tuple[Tensor, Tensor]]:
    """An eager copy's attentions of one image, their gradients, and the tokens T at ``norm1``
    (the last first-norm) with dy/dT.

    Args:
        model: a Hugging Face vision model (SDPA attention).
        image: (3, H, W) input.
        score_fn: the model's output -> (1,) score to differentiate.
        norm1: module name of the norm whose output enters the last attention.

    Returns:
        ([A_l (H, N, N)], [dy/dA_l (H, N, N)], (T (N, D), dy/dT (N, D))).
    """
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    kept = []
    ref.get_submodule(norm1).register_forward_hook(lambda m, a, o: (o.retain_grad(), kept.append(o))[0])
    out = ref(pixel_values=image[None], output_attentions=True)
    for a in out.attentions:
        a.retain_grad()
    score_fn(out)[0].backward()
    tokens = kept[0]
    return [a[0].detach() for a in out.attentions], [a.grad[0] for a in out.attentions], (tokens[0].detach(), tokens.grad[0])
