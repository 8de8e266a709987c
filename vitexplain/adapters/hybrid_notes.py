"""Why the attention of some conv/attention hybrids cannot be read, per model family.

The attention methods (raw, rollout, Chefer's rule, CDAM, ...) read token-to-token attention matrices, each
the mixing a block applies to one set of tokens. These timm families mix tokens otherwise: their hybrids get
the Grad-CAM family on their conv stages (:mod:`vitexplain.adapters.cnn`), and a request for an attention
method is refused with the reason below (``adapter.notes["family"]``). Also families whose attention has no
softmax (linear, additive attention) are hybrids here: :func:`vitexplain.adapters.cnn.calls_attention` alone
would take them for plain CNNs and give no reason.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

__all__ = ["mixer_reason", "block_reason", "hybrid_note"]

#: (timm module, why its attention cannot be read: completes "<class name> ...")
_REASONS: tuple[tuple[str, str], ...] = (
    ("timm.models.efficientformer_v2",
     "mixes its heads with a linear map after the softmax (talking heads) and adds a local conv of the values to "
     "the attention output, so no recorded softmax is the attention applied to the values and neither the ViT nor "
     "the hierarchical rules hold"),
    ("timm.models.efficientvit_mit",
     "mixes tokens with ReLU linear attention (LiteMLA): it multiplies ReLU(K)^T by the values before the queries, "
     "so no token-to-token attention matrix is ever formed (there is no softmax to record), and depthwise convs of "
     "q, k and v mix neighbouring tokens first; the attention methods have nothing to read"),
    ("timm.models.efficientvit_msra",
     "uses cascaded group attention: each head reads its own channel split plus the previous head's output (its "
     "queries through a depthwise conv), so a block's heads are a chain of mixings, not parallel maps of one set "
     "of tokens, and their mean (what rollout and Chefer's rule take) is not how the block mixes tokens"),
    ("timm.models.swiftformer",
     "uses efficient additive attention: it pools the query tokens into one global vector (weights from a learned "
     "vector, L2-normalised over the tokens, not a softmax) and multiplies it element-wise with each key, so no "
     "token attends to another and there is no token-to-token attention matrix to read"),
    ("timm.models.davit",
     "alternates window attention with channel attention, a softmax over channels (C x C per head, from all "
     "tokens) that mixes channels, not tokens, and adds a depthwise conv before each attention; its recorded "
     "channel softmaxes are not token-to-token maps, so the attention methods cannot chain them"),
)


def mixer_reason(model: nn.Module) -> Optional[str]:
    """Why ``model``'s attention cannot be read as token-to-token maps (completes "<class name> ..."), or None
    when its family is not one of these."""
    for module, reason in _REASONS:
        if any(cls.__module__.startswith(module) for cls in type(model).__mro__):
            return reason
    return None


#: (timm module, layer class, what a CNN block of that class does with its softmax: completes "its <class> ...").
#: None of these softmaxes is the attention of a token sequence the ViT methods read; vx.capture records only
#: BotNet's (its (B * heads, N, N) softmax inside a module with ``num_heads``, as nn.MultiheadAttention's).
_BLOCK_REASONS: tuple[tuple[str, str, str], ...] = (
    ("timm.layers.selective_kernel", "SelectiveKernel",
     "weights its kernel branches with a softmax over the branches, per channel (selective kernel): a mixing of "
     "branches, not of tokens"),
    ("timm.layers.split_attn", "SplitAttn",
     "weights its radix splits with a softmax over the splits, per channel (ResNeSt split attention): a mixing of "
     "splits, not of tokens"),
    ("timm.layers.global_context", "GlobalContext",
     "pools one context vector per image with a softmax over the positions (no queries: no token attends to "
     "another); 'channel' reads its channel gate where it scales the features"),
    ("timm.layers.lambda_layer", "LambdaLayer",
     "normalises its keys with a softmax over the positions and applies their summary to every query as one "
     "linear map (lambda layer), so no position attends to another"),
    ("timm.layers.bottleneck_attn", "BottleneckAttn",
     "computes self-attention among the positions of a conv feature map (BotNet, relative position logits added), "
     "which vx.capture records ((B, heads, N, N) per block: rec.records[i].probs()); a conv block holds it, with no "
     "token sequence for the ViT attention methods"),
    ("timm.layers.halo_attn", "HaloAttn",
     "computes self-attention within blocks of a conv feature map, each block's queries over a haloed window "
     "(HaloNet): no token sequence for the ViT attention methods, and vx.capture does not record it (its softmax "
     "is laid out (B * heads, blocks, block positions, window positions), not (B, heads, N, N))"),
)


def block_reason(model: nn.Module) -> Optional[str]:
    """What the softmax-calling timm blocks of a CNN do (completes "<class name> ..."), or None when it has none
    of them: why the attention methods do not apply, and what vx.capture records of them."""
    found = {(type(m).__module__, type(m).__name__) for m in model.modules()}
    parts = [f"its {cls} {why}" for module, cls, why in _BLOCK_REASONS if (module, cls) in found]
    if not parts:
        return None
    return "is a CNN whose blocks call a softmax the attention methods cannot read: " + "; ".join(parts)


def hybrid_note(model: nn.Module) -> str:
    """Why a conv/attention hybrid gets the Grad-CAM family and not the attention methods."""
    name = type(model).__name__
    tail = ("the Grad-CAM family explains its last stage, and vx.capture(model) records every attention call "
            "(rec.records[i].probs())")
    reason = mixer_reason(model) or block_reason(model)
    if reason is not None:
        return f"{name} {reason}; the Grad-CAM family explains its last stage"
    return (f"{name} is a conv/attention hybrid that no attention family describes (the hierarchical family "
            "covers PVTv2, Twins, SAM's ViT, PiT, MaxViT, CoAtNet, CAFormer, TinyViT, LeViT, MViTv2, Hiera, SAM 2's "
            "Hiera, CrossViT and TNT); "
            + tail)
