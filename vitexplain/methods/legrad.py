"""LeGrad: layer-wise gradients of the head's score w.r.t. each layer's attention."""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from .context import Context, query_blocks
from .options import Option, check_indices
from .families import VIT
from .registry import register

__all__ = ["legrad"]


def _all_blocks(adapter) -> list[str]:
    return list(adapter.blocks)


@register(
    "legrad", VIT,
    options={
        "layers": Option(int, optional=True, sequence=True, help="layer indices (None = the default layers)"),
    },
    grads=True,
    requires=("grid", "attention", "head"),
    activations=_all_blocks,
    retain_graph=True,
    summary="LeGrad: mean over layers of ReLU(d s_l / d A_l), s_l the head applied to layer l's tokens",
    reference="Bousselham et al. 2024; docs/methods.md",
    dense_attention=True,
)
def legrad(ctx: Context, *, layers: Union[None, int, Sequence[int]] = None) -> Tensor:
    """LeGrad (Bousselham et al. 2024).

    For each chosen layer l, the layer's output tokens are pooled the way the head does,
    through the final norm and classifier (``s_l = head(tokens_l)``);
    ``E_l = mean over heads and queries of ReLU(d s_l[c] / d A[l])`` over the patch keys,
    computed from ``dO_l @ V_l^T`` in query blocks. The map is ``mean_l E_l``, min-max
    normalised per image.

    Layers: by default all of them, as the paper defines LeGrad (the signal "aggregated over all
    layers"). The authors' released code averages only the last two by default
    (``LeWrapper(layer_index=-2)``); ``layers=[-2, -1]`` reproduces it (docs/methods.md).

    Args:
        ctx: the captured forward (gradients enabled).
        layers: layer indices to use, negative from the last (default: all layers).

    Returns:
        (B, gh, gw) float32 in [0, 1].
    """
    layout = ctx.require_grid()
    records = ctx.layers()
    adapter = ctx.adapter
    head = ctx.head()
    if layers is None:
        chosen = list(range(len(records)))
    else:
        chosen = check_indices(ctx.method, "layers", layers, len(records), "layers")
    total = torch.zeros(ctx.batch_size, layout.num_tokens, device=records[0].device)
    with torch.enable_grad():
        for i in chosen:
            record = records[i]
            tokens = ctx.recorder.activation(adapter.blocks[i]).output
            score = ctx.score(head(tokens))
            (d_out,) = torch.autograd.grad(score.sum(), record.output, retain_graph=True)
            layer_sum = torch.zeros_like(total)
            for block in query_blocks(record):
                layer_sum += torch.relu(record.grad_probs(block, d_out=d_out)).sum(dim=(1, 2))
            total += layer_sum / (record.num_heads * record.num_queries)
    maps = layout.to_grid(total / len(chosen)).flatten(1)
    low, high = maps.amin(1, keepdim=True), maps.amax(1, keepdim=True)
    maps = (maps - low) / (high - low).clamp(min=1e-12)
    return maps.view(-1, *layout.grid)
