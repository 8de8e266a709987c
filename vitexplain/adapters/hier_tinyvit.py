"""Hierarchical adapter for timm's TinyViT (``tiny_vit_*``; MobileSAM's image encoder family).

TinyViT embeds patches with two strided convs, runs MBConv blocks on stage 0 (no attention) and, on later
stages, window attention (windows of ``window_size``, the grid zero-padded at the bottom / right; the
padding tokens go through the attention's own norm and are attended to, as in SAM's ViT) with a residual,
then a 3 x 3 depthwise conv and an MLP. Between stages a ``PatchMerging`` resamples the grid with its
strided 3 x 3 depthwise conv (its 1 x 1 convs are token-wise). Its chain: per stage that conv's
footprint, then one windowed call per block; the depthwise convs (MBConv, ``local_conv``) are taken as
token-wise (docs/methods.md, "Hierarchical transformers"). The head averages the last tokens.

The token site of a stage is the norm inside its last block's attention: its output is the tokens of
every (padded) window, (B * nW, ws * ws, C); :meth:`TinyViTAdapter.site_grid` puts them back on the grid
(the model's own window reverse) and drops the padding.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor, nn

from ..layout import pair
from ..methods.families import HIER
from ..methods.resample import CallSpec, Footprint, TokenSet, Transition, window_slots
from .base import Adapter, register_adapter
from .hier import Chain, HierAdapter, conv_footprint, conv_grid, module_family, token_set

__all__ = ["TinyViTAdapter"]


class TinyViTAdapter(HierAdapter):
    """timm ``TinyVit``: an MBConv stage, then window-attention stages joined by strided depthwise convs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.token_sites = [f"stages.{s}.blocks.{len(stage.blocks) - 1}.attn.norm" if _windowed(stage) else None
                            for s, stage in enumerate(model.stages)]
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        """Every block of the last stage (window attention on its grid; only stage 0 is MBConv)."""
        last = len(self.model.stages) - 1
        return [f"stages.{last}.blocks.{b}.attn" for b in range(len(self.model.stages[last].blocks))]

    def head_layout(self, module: str, tokens: Tensor) -> Tensor:
        """A block's (B, H, W, C) output as the (B, C, H, W) map the stage hands the head."""
        return tokens.permute(0, 3, 1, 2)

    def head_on(self, tokens: Tensor) -> Tensor:
        """The model's head (average pooling, channel norm, classifier) on (B, C, H, W) maps."""
        return self.model.forward_head(tokens)

    def _window(self, stage: int) -> int:
        return int(self.model.stages[stage].blocks[-1].window_size)

    def site_grid(self, stage: int, output: Tensor, input_size: Sequence[int]) -> Tensor:
        """(B * nW, ws * ws, C) window tokens (row-major windows of the padded grid) as (B, H_s, W_s, C)."""
        (h, w), ws = self.stage_sets(input_size)[stage].grid, self._window(stage)
        nh, nw = -(-h // ws), -(-w // ws)
        c = output.shape[-1]
        grid = output.reshape(-1, nh, nw, ws, ws, c).transpose(2, 3).reshape(-1, nh * ws, nw * ws, c)
        return grid[:, :h, :w]

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        grid = pair(input_size)
        for conv in (m for m in self.model.patch_embed.modules() if isinstance(m, nn.Conv2d)):
            grid = conv_grid(grid, conv.kernel_size, conv.stride, conv.padding)
        tokens = token_set(grid)
        chain: Chain = []
        sets: list[TokenSet] = []
        for s, stage in enumerate(self.model.stages):
            down = getattr(getattr(getattr(stage, "downsample", None), "conv2", None), "conv", None)
            if isinstance(down, nn.Conv2d):
                footprint = conv_footprint(tokens, down)
                chain.append(Transition(footprint, s - 1, s, f"stages.{s}.downsample.conv2"))
                tokens = footprint.coarse
            sets.append(tokens)
            if not _windowed(stage):
                continue
            identity = Footprint.identity(tokens)
            for b, block in enumerate(stage.blocks):
                ws = int(block.window_size)
                # one window when the grid is the window (the model then skips its partition: the same slots)
                slots = window_slots(tokens, (ws, ws))
                chain.append(CallSpec(f"stages.{s}.blocks.{b}.attn", tokens, tokens, slots, slots, identity, identity,
                                      s, s))
        return chain, sets


def _windowed(stage: nn.Module) -> bool:
    """Whether a TinyViT stage's blocks are window-attention blocks (not the MBConv stage)."""
    return all(hasattr(block, "window_size") and hasattr(block, "attn") for block in stage.blocks)


@register_adapter(priority=15, family=HIER)
def _detect_tinyvit(model: nn.Module) -> Optional[Adapter]:
    if (module_family(model, "timm.models.tiny_vit") and hasattr(model, "stages") and hasattr(model, "patch_embed")
            and any(_windowed(stage) for stage in model.stages)):
        return TinyViTAdapter(model)
    return None
