"""Hierarchical adapter for timm's MetaFormer with attention stages: CAFormer (``caformer_*``).

CAFormer's stages 0 and 1 mix tokens with separable convs (``SepConv``), stages 2 and 3 with global
attention (no position bias); the stem (a strided conv) and each later stage's ``downsample`` (a strided
conv) resample the grid, and the head averages the last tokens. Its chain: per stage the downsample's
footprint, then one global call per attention block; the conv token mixers are taken as token-wise (as
MBConv blocks are for MaxViT and CoAtNet: docs/methods.md, "Hierarchical transformers"), so the conv
stages are reached through the footprints only and the token methods are refused there. MetaFormers
without attention (ConvFormer, PoolFormer) stay CNNs.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from ..layout import pair
from ..methods.families import HIER
from ..methods.resample import TokenSet, Transition
from .base import Adapter, register_adapter
from .hier import Chain, HierAdapter, conv_footprint, conv_grid, global_call, module_family, token_set

__all__ = ["CAFormerAdapter"]

#: token mixers the chain knows: attention (a call) and separable convs (taken as token-wise)
_MIXERS = frozenset({"Attention", "SepConv"})


def _mixer(module: object) -> str:
    """The name of the timm MetaFormer token mixer ``module`` is (or derives from), else its class name."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("timm.models.metaformer") and cls.__name__ in _MIXERS:
            return cls.__name__
    return type(module).__name__


def _is_attention(block: nn.Module) -> bool:
    return _mixer(block.token_mixer) == "Attention"


class CAFormerAdapter(HierAdapter):
    """timm ``MetaFormer`` whose token mixers are separable convs and global attention (CAFormer)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        sites: list[Optional[str]] = []
        for s, stage in enumerate(model.stages):
            last = next((b for b in reversed(range(len(stage.blocks))) if _is_attention(stage.blocks[b])), None)
            sites.append(None if last is None else f"stages.{s}.blocks.{last}.norm1")  # (B, N, C) tokens
        self.token_sites = sites
        if self.legrad_calls():
            self.offer_legrad()
        else:
            self.notes["head"] = (
                f"the last stage of {type(model).__name__} mixes its tokens with separable convs, no attention, so no "
                "block outputs tokens the head reads with an attention over them (LeGrad); use 'generic' or "
                "'grad_rollout', or 'cdam' (stage=...)")

    def legrad_calls(self) -> list[str]:
        """The last stage's attention blocks (a stage's blocks share one token mixer)."""
        last = len(self.model.stages) - 1
        return [f"stages.{last}.blocks.{b}.token_mixer" for b, block in enumerate(self.model.stages[last].blocks)
                if _is_attention(block)]

    def head_layout(self, module: str, tokens: Tensor) -> Tensor:
        """A block's (B, N, C) tokens as a (B, C, N, 1) map: the head's pooling over it (mean, max or both) is the
        pooling over the tokens, whatever the grid's shape."""
        return tokens.transpose(1, 2)[..., None]

    def head_on(self, tokens: Tensor) -> Tensor:
        """The model's head (global pooling, norm, classifier) on (B, C, H, W) maps."""
        return self.model.forward_head(tokens)

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        conv = self.model.stem.conv
        tokens = token_set(conv_grid(pair(input_size), conv.kernel_size, conv.stride, conv.padding))
        chain: Chain = []
        sets: list[TokenSet] = []
        for s, stage in enumerate(self.model.stages):
            down = getattr(stage.downsample, "conv", None)
            if isinstance(down, nn.Conv2d):
                footprint = conv_footprint(tokens, down)
                chain.append(Transition(footprint, s - 1, s, f"stages.{s}.downsample.conv"))
                tokens = footprint.coarse
            sets.append(tokens)
            chain += [global_call(f"stages.{s}.blocks.{b}.token_mixer", tokens, s)
                      for b, block in enumerate(stage.blocks) if _is_attention(block)]
        return chain, sets


@register_adapter(priority=15, family=HIER)
def _detect_caformer(model: nn.Module) -> Optional[Adapter]:
    if not (module_family(model, "timm.models.metaformer") and hasattr(model, "stages") and hasattr(model, "stem")):
        return None
    blocks = [block for stage in model.stages for block in stage.blocks]
    mixers = {_mixer(getattr(block, "token_mixer", None)) for block in blocks}
    if blocks and mixers <= _MIXERS and "Attention" in mixers:
        return CAFormerAdapter(model)
    return None
