"""Gradient-weighted attention maps: gradient rollout, Chefer's generic rule, attention Grad-CAM.

``grad(y, A)`` comes from the capture as ``dO @ V^T`` (no eager attention), recomputed in
query blocks together with A, so these keep the fused kernel forward and backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..recording import AttentionRecord
from .attention import contract_rows, propagate, weighted_head_mean
from .context import Context, live_blocks
from .options import Option, check_index
from .families import VIT
from .registry import register

__all__ = ["grad_rollout", "generic", "attn_gradcam"]


def _grad_rollout_rows(record: AttentionRecord, block: slice) -> Tensor:
    return (record.probs(block) * record.grad_probs(block)).mean(dim=1).clamp(min=0)


def _generic_contract(record: AttentionRecord, block: slice, weights) -> tuple[Tensor, Tensor]:
    """``w @ mean_h(clamp(dy/dA * A, 0))[rows]`` without materialising the head mean."""
    m = (record.grad_probs(block) * record.probs(block)).clamp_(min=0)  # (B, H, n, N)
    w = weights(None)  # Chefer's rule needs no row sums
    return weighted_head_mean(w, m), w


@register(
    "grad_rollout", VIT,
    options={
        "discard_ratio": Option(float, low=0, high=1, high_open=True, help="fraction of smallest fused entries zeroed per layer"),
        "start_layer": Option(int, low=0, help="first layer included"),
    },
    grads=True,
    requires=("grid", "attention", "rollout"),
    summary="gradient rollout: rollout of clamp(mean_h(A * dy/dA), 0)",
    reference="vit-explain (Gildenblat 2020), forward-ordered gradients; docs/methods.md",
    dense_attention=True,
)
def grad_rollout(ctx: Context, *, discard_ratio: float = 0.0, start_layer: int = 0) -> Tensor:
    """Gradient attention rollout.

    As rollout, with ``fused = clamp(mean_h(A * grad(y, A)), min=0)`` per layer: the gradient
    of the score with respect to the attention probabilities A, each layer's gradient paired
    with that same layer's attention. vit-explain's code differs on both counts (not
    reproduced; docs/methods.md): its backward hook on ``attn_drop`` records the gradient with
    respect to the pre-softmax scores (dropout is the identity in eval, so the hook sees the
    softmax's inputs), and it pairs backward-ordered gradients with forward-ordered attentions.

    Args:
        ctx: the captured forward and backward.
        discard_ratio: fraction of smallest fused entries zeroed per layer and image.
        start_layer: first layer included.

    Returns:
        (B, gh, gw) float32.
    """
    layers = ctx.layers(start_layer)
    layout = ctx.require_grid(rollout=True)
    vector = ctx.readout(layout, weighting="rollout")
    keep = 0 if layout.readout == "class" and layout.has_class_token else None
    out = propagate(
        vector, layers, contract_rows(_grad_rollout_rows), mode="rollout",
        discard_ratio=discard_ratio, keep=keep, rows_fn=_grad_rollout_rows, minus_identity=True,
    )
    return layout.to_grid(out)


@register(
    "generic", VIT,
    options={
        "start_layer": Option(int, low=0, help="first layer included"),
    },
    grads=True,
    requires=("grid", "attention", "rollout"),
    summary="Chefer generic attention explainability: R += mean_h(clamp(dy/dA * A, 0)) @ R",
    reference="Chefer, Gur & Wolf, ICCV 2021; docs/methods.md",
    dense_attention=True,
)
def generic(ctx: Context, *, start_layer: int = 0) -> Tensor:
    """Chefer et al. (2021) generic relevance for self-attention.

    ``Abar[l] = mean_h(clamp(grad(y, A[l]) * A[l], min=0))``; ``R = I``;
    ``R = R + Abar[l] @ R`` for l = 1..L; the map is the readout row of ``R - I`` over the
    patch keys (no normalisation, as in the paper's self-attention case): for a class-token
    readout that is Chefer's ``R[0, 1:]``; for average pooling the identity's uniform 1/N
    share is removed (docs/methods.md, "Readout"). Computed as a row vector pushed through
    the layers last to first, so no N x N product is formed.

    Args:
        ctx: the captured forward and backward.
        start_layer: first layer included.

    Returns:
        (B, gh, gw) float32.
    """
    layers = ctx.layers(start_layer)
    layout = ctx.require_grid(rollout=True)
    vector = ctx.readout(layout, weighting="generic")
    return layout.to_grid(propagate(vector, layers, _generic_contract, mode="generic", minus_identity=True))


@register(
    "attn_gradcam", VIT,
    options={
        "layer": Option(int, help="layer index, negative counts from the last"),
    },
    grads=True,
    requires=("grid", "attention"),
    summary="attention Grad-CAM on the last layer: clamp(mean_h(w_h A_h[readout]), 0)",
    reference="Chefer et al. 2021 baseline (their implementation); docs/methods.md",
)
def attn_gradcam(ctx: Context, *, layer: int = -1) -> Tensor:
    """Grad-CAM on the last layer's attention.

    Per head h the readout row of A (patch keys) is the "feature map" and
    ``w_h = mean(grad(y, A)_h)`` over the same entries (as in Chefer et al.'s code);
    the map is ``clamp(mean_h(w_h * A_h[readout, patches]), min=0)``.

    Args:
        ctx: the captured forward and backward.
        layer: which layer (default: the last).

    Returns:
        (B, gh, gw) float32.
    """
    layers = ctx.layers()
    record = layers[check_index(ctx.method, "layer", layer, len(layers), "layers")]
    layout = ctx.require_grid()
    vector = ctx.readout(layout)
    attn = torch.zeros(record.batch_size, record.num_heads, record.num_keys, device=record.device)
    grad = torch.zeros_like(attn)
    for rows in live_blocks(record, vector):  # only the readout rows
        w = vector[:, None, rows, None]
        attn += (w * record.probs(rows)).sum(dim=2)
        grad += (w * record.grad_probs(rows)).sum(dim=2)
    attn, grad = attn[..., layout.patch_slice], grad[..., layout.patch_slice]
    head_weights = grad.mean(dim=-1, keepdim=True)
    cam = (head_weights * attn).mean(dim=1).clamp(min=0)
    return layout.to_grid(cam)
