"""Hierarchical adapters for timm's pooling transformers: PiT, MaxViT / CoAtNet, LeViT and MViTv2.

Each describes its model as a chain (:mod:`vitexplain.methods.resample`) read from the
model's own modules:

- PiT: ViT blocks with a class token per stage; between stages a depthwise conv of kernel
  s + 1, stride s (the class token through a linear layer: prefix kept).
- MaxViT: per block an MBConv (its stride-2 depthwise conv is the stage transition), block
  attention in windows and grid attention in dilated windows, each with a residual. CoAtNet (same
  model class): conv stages (strided conv or pooling), then global attention, the first block of a
  stage pooling 2 x 2 for both its attention and its shortcut.
- LeViT: attention blocks on one grid per stage; between stages an attention whose queries
  are subsampled (no residual around it), keys over the whole previous grid.
- MViTv2: pooled queries, keys and values (each a conv or pooling); the first block of a
  stage pools its queries (the stage transition) and its residual through a max pooling.
- TNT: the outer (patch) tokens with their class token, one grid; the inner attention runs
  inside each patch's pixels and mixes no patches, so it is left out of the chain.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import Tensor, nn

from ..layout import pair
from ..methods.families import HIER
from ..methods.resample import CallSpec, Footprint, TokenSet, Transition, full_slots, grid_slots, window_slots
from .base import Adapter, register_adapter
from .hier import Chain, HierAdapter, conv_footprint, conv_grid, global_call, module_family, token_set

__all__ = ["PiTAdapter", "MaxViTAdapter", "LeViTAdapter", "MViTv2Adapter", "TNTAdapter"]


#: Why a LeViT (timm's or Hugging Face's) without such a last block has no smooth or integrated CDAM.
_LEVIT_TAIL = (
    "in {} the last stage has no attention block whose input is the tokens entering the last attention (T) and whose "
    "output the head reads, so smooth and integrated CDAM have no block to re-run from T; use 'cdam'")


# -- PiT ---------------------------------------------------------------------------------------
class PiTAdapter(HierAdapter):
    """timm ``PoolingVisionTransformer`` (PiT, also distilled): class-token readout."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.prefix = int(model.cls_token.shape[1])
        self.readout = "prefix" if self.prefix > 1 else "class"  # distilled: mean of the two heads
        self.token_sites = [f"transformers.{s}.blocks.{len(t.blocks) - 1}.norm1" for s, t in enumerate(model.transformers)]
        self.fixed_size = tuple(pair(model.patch_embed.img_size)) if hasattr(model.patch_embed, "img_size") else None
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        last = len(self.model.transformers) - 1
        return [f"transformers.{last}.blocks.{b}.attn" for b in range(len(self.model.transformers[last].blocks))]

    def head_on(self, tokens: Tensor) -> Tensor:
        """The final norm on the prefix tokens of (B, prefix + N, C) tokens, then the model's head."""
        return self.model.forward_head(self.model.norm(tokens[:, :self.prefix]))

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        conv = self.model.patch_embed.conv
        tokens = token_set(conv_grid(input_size, conv.kernel_size, conv.stride, conv.padding), self.prefix)
        chain: Chain = []
        sets: list[TokenSet] = []
        for s, stage in enumerate(self.model.transformers):
            if stage.pool is not None:
                footprint = conv_footprint(tokens, stage.pool.conv)
                chain.append(Transition(footprint, s - 1, s, f"transformers.{s}.pool"))
                tokens = footprint.coarse
            sets.append(tokens)
            chain += [global_call(f"transformers.{s}.blocks.{b}.attn", tokens, s) for b in range(len(stage.blocks))]
        return chain, sets


def _same_padding(conv: nn.Conv2d, grid: tuple[int, int]) -> tuple[int, int]:
    """The padding before the first row / column: TF-style 'same' convs (``Conv2dSame``) pad
    ``total // 2`` before and the rest after; others pad symmetrically."""
    k, s = pair(conv.kernel_size), pair(conv.stride)
    if "Same" not in type(conv).__name__:
        return pair(conv.padding) if any(pair(conv.padding)) else (k[0] // 2, k[1] // 2)
    return tuple(max((-(-g // ss) - 1) * ss + kk - g, 0) // 2 for g, kk, ss in zip(grid, k, s))  # type: ignore[return-value]


# -- MaxViT / CoAtNet ---------------------------------------------------------------------------
_STRIDED = (nn.Conv2d, nn.AvgPool2d, nn.MaxPool2d)


def _strided(block: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """(name, module) of the conv or pooling that resamples a MaxxVit block's grid on its main path, or None.

    MaxViT blocks: the strided depthwise conv of their MBConv / ConvNeXt block (``conv``). Conv blocks of a
    CoAtNet: that conv (``stride_mode='dw'``) or the pooling before it (``'pool'``: ``down.pool``). Transformer
    blocks: the pooling inside ``norm1`` that both the attention and the shortcut read (``shortcut.pool``, the
    same pooling, is skipped)."""
    root = block.conv if hasattr(block, "attn_grid") else block
    for name, module in root.named_modules():
        if not name.startswith("shortcut") and isinstance(module, _STRIDED) and pair(module.stride) != (1, 1):
            return name, module
    return None


def _calls(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """(suffix, module) of a MaxxVit block's attention calls: block and grid attention (MaxViT; grid only for
    MaxxViT-V2), the global attention of a transformer block (CoAtNet), none for a conv block."""
    if hasattr(block, "attn_grid"):
        return [(part, getattr(block, part)) for part in ("attn_block", "attn_grid") if getattr(block, part) is not None]
    attn = getattr(block, "attn", None)
    return [("", block)] if attn is not None and type(block).__name__ == "TransformerBlock2d" else []


class MaxViTAdapter(HierAdapter):
    """timm ``MaxxVit``: MaxViT blocks (``maxvit_*``, ``maxxvit*``: window and grid attention after an MBConv or
    ConvNeXt block; MaxxViT-V2: grid attention only; channels-last (``*_rw``) and NCHW (``*_tf``) partitions) and
    CoAtNet (``coatnet_*``, ``coatnext_*``: conv stages of MBConv or ConvNeXt blocks, then transformer blocks with
    global attention (relative position bias) on the whole grid, the first pooling it 2 x 2 for both the
    attention and its shortcut). A stage of conv blocks has no attention: its grid is reached through the
    strided convs and poolings (their footprints), and the token methods are refused there."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        sites: list[Optional[str]] = []
        for s, st in enumerate(model.stages):
            last = next((b for b in reversed(range(len(st.blocks))) if _calls(st.blocks[b])), None)
            part = _calls(st.blocks[last])[-1][0] if last is not None else None
            sites.append(None if last is None else f"stages.{s}.blocks.{last}." + (f"{part}.norm1" if part else "norm1"))
        self.token_sites = sites
        # its partition sizes (relative position tables) are derived from img_size (img_size / 32 unless set):
        # images are preprocessed to it (the pretrained config's 224 px need not split into them), and a size whose
        # stage grids they do not divide is refused with that size to use (it takes any other)
        size = getattr(model, "img_size", None)
        self.fixed_size = tuple(pair(size)) if size is not None else None
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        last = len(self.model.stages) - 1
        return [f"stages.{last}.blocks.{b}." + (f"{part}.attn" if part else "attn")
                for b, block in enumerate(self.model.stages[last].blocks) for part, _ in _calls(block)]

    def head_layout(self, module: str, tokens: Tensor) -> Tensor:
        """A block's (or its window / grid attention's) output as (B, C, H, W) (channels-last ones permuted)."""
        return tokens.permute(0, 3, 1, 2) if type(self.model.get_submodule(module)).__name__.endswith("Cl") else tokens

    def head_on(self, tokens: Tensor) -> Tensor:
        """The final norm, then the model's head, on (B, C, H, W) maps."""
        return self.model.forward_head(self.model.norm(tokens))

    def site_grid(self, stage: int, output: Tensor, input_size: Sequence[int]) -> Tensor:
        site = self.token_sites[stage] or ""
        channels_last = site.endswith(".attn_grid.norm1") and type(self.model.get_submodule(site[:-6])).__name__.endswith("Cl")
        return output if channels_last else output.permute(0, 2, 3, 1)

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        grid = pair(input_size)
        for conv in (m for m in self.model.stem.modules() if isinstance(m, nn.Conv2d)):
            grid = conv_grid(grid, conv.kernel_size, conv.stride, conv.kernel_size[0] // 2)
        chain: Chain = []
        sets: list[TokenSet] = []
        tokens: Optional[TokenSet] = None
        for s, stage in enumerate(self.model.stages):
            for b, block in enumerate(stage.blocks):
                found = _strided(block)
                if found is not None:  # the strided conv or pooling resamples the grid
                    name, dw = found
                    k, st = pair(dw.kernel_size), pair(dw.stride)
                    fine = tokens.grid if tokens else grid
                    same_pool = "Same" in type(dw).__name__  # TF 'same' poolings pad as Conv2dSame does
                    pad = _same_padding(dw, fine) if isinstance(dw, nn.Conv2d) or same_pool else pair(dw.padding)
                    same = "Same" in type(dw).__name__  # output ceil(g / s)
                    coarse = token_set(tuple(-(-g // ss) for g, ss in zip(fine, st)) if same else conv_grid(fine, k, st, pad))
                    if tokens is not None:
                        where = f"stages.{s}.blocks.{b}." + ("conv." if hasattr(block, "attn_grid") else "") + name
                        chain.append(Transition(Footprint.pool(tokens, coarse, k, st, pad), s - 1 if b == 0 else s, s, where))
                    tokens = coarse
                elif tokens is None:
                    tokens = token_set(grid)
                if b == 0:
                    sets.append(tokens)
                for part, module in _calls(block):
                    name = f"stages.{s}.blocks.{b}." + (f"{part}.attn" if part else "attn")
                    if not part:  # global attention over the whole grid
                        chain.append(global_call(name, tokens, s))
                        continue
                    size = pair(module.partition_size)
                    slots = window_slots(tokens, size) if module.partition_block else grid_slots(tokens, size)
                    identity = Footprint.identity(tokens)
                    chain.append(CallSpec(name, tokens, tokens, slots, slots, identity, identity, s, s))
        return chain, sets


# -- LeViT -------------------------------------------------------------------------------------
class LeViTAdapter(HierAdapter):
    """timm ``Levit`` / ``LevitDistilled`` (linear and conv mode): the tokens entering a stage's last
    attention are its block input (LeViT's attention has no norm before it), so CDAM's
    gradient there also runs through that block's residual."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        # its attention biases are built for one token grid: the input size that makes it
        grids = [pair(m.resolution) for m in model.stages.modules() if hasattr(m, "attention_bias_idxs")]
        stride = int(getattr(model.stem, "stride", 16))
        self.fixed_size = (grids[0][0] * stride, grids[0][1] * stride) if grids else None
        sites: list[Optional[str]] = []
        for s, stage in enumerate(model.stages):
            n = len(stage.blocks)
            if n >= 2:
                sites.append(f"stages.{s}.blocks.{n - 2}")
            elif n == 1 or not isinstance(stage.downsample, nn.Identity):
                # the downsample's output enters the stage's one block (stage 0's is an identity: the stem's tokens)
                sites.append(f"stages.{s}.downsample")
            else:
                sites.append(None)
        self.token_sites = sites
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        last = len(self.model.stages) - 1
        return [f"stages.{last}.blocks.{b}.attn" for b in range(len(self.model.stages[last].blocks))]

    def head_on(self, tokens: Tensor) -> Tensor:
        """The model's head (mean over the tokens, then its norm-linear classifiers) on (B, N, C) tokens or
        (B, C, H, W) maps."""
        return self.model.forward_head(tokens)

    def tail_block(self) -> Any:
        """The last stage's last block: its input is T (``token_sites[-1]``'s output: the block before it, or the
        stage's downsampling), and the head reads its output."""
        stage = len(self.model.stages) - 1
        if self.token_sites[-1] is None or not len(self.model.stages[stage].blocks):
            return None
        return f"stages.{stage}.blocks.{len(self.model.stages[stage].blocks) - 1}"

    def tail_input_is_t(self) -> bool:
        return True

    def tail_refusal(self) -> str:
        return _LEVIT_TAIL.format(type(self.model).__name__)

    def site_grid(self, stage: int, output: Tensor, input_size: Sequence[int]) -> Tensor:
        """A token site's output on the stage grid: (B, N, C) tokens (linear mode) or (B, C, H, W) maps
        (``levit_conv_*``, ``use_conv=True``) as (B, H_s, W_s, C)."""
        if getattr(self.model, "use_conv", False):
            return output.permute(0, 2, 3, 1)
        return super().site_grid(stage, output, input_size)

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        grid = pair(input_size)
        for conv in (m for m in self.model.stem.modules() if isinstance(m, nn.Conv2d)):
            grid = conv_grid(grid, conv.kernel_size, conv.stride, conv.padding)
        tokens = token_set(grid)
        chain: Chain = []
        sets: list[TokenSet] = []
        for s, stage in enumerate(self.model.stages):
            if not isinstance(stage.downsample, nn.Identity):
                down = stage.downsample.attn_downsample
                stride = int(down.q.down.stride)
                coarse = token_set(tuple((g - 1) // stride + 1 for g in tokens.grid))
                chain.append(CallSpec(f"stages.{s}.downsample.attn_downsample", tokens, coarse, full_slots(coarse),
                                      full_slots(tokens), Footprint.identity(tokens), None, s - 1, s))
                tokens = coarse
            sets.append(tokens)
            chain += [global_call(f"stages.{s}.blocks.{b}.attn", tokens, s) for b in range(len(stage.blocks))]
        return chain, sets


# -- MViTv2 ------------------------------------------------------------------------------------
class MViTv2Adapter(HierAdapter):
    """timm ``MultiScaleVit`` (MViTv2): pooled q / k / v, pooled residual, class token if any."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.prefix = 1 if getattr(model, "cls_token", None) is not None else 0
        self.readout = "class" if model.global_pool == "token" else "mean"
        # per stage, the tokens entering the last attention that reads the stage's grid: its last block, or, when
        # that block pools the previous grid (a stage of one block), the next stage's first block (reading this
        # stage's output); none for a last stage of one such block (as Hiera's, adapters/hier_more.py)
        self.token_sites = []
        for s, stage in enumerate(model.stages):
            last = len(stage.blocks) - 1
            if not (s > 0 and last == 0 and _pools_queries(stage.blocks[last])):
                self.token_sites.append(f"stages.{s}.blocks.{last}.norm1")
            else:
                self.token_sites.append(f"stages.{s + 1}.blocks.0.norm1" if s + 1 < len(model.stages) else None)
        # relative (or absolute) position tables are built for the stages' feature sizes: the input size that makes them
        fixed = getattr(model, "pos_embed", None) is not None or any(
            hasattr(m, "rel_pos_h") for m in model.stages.modules())
        feat, stride = getattr(model.stages[0], "feat_size", None), pair(model.patch_embed.proj.stride)
        self.fixed_size = (feat[0] * stride[0], feat[1] * stride[1]) if fixed and feat is not None else None
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        last = len(self.model.stages) - 1
        blocks = self.model.stages[last].blocks
        return [f"stages.{last}.blocks.{b}.attn" for b in range(len(blocks))
                if not (last > 0 and _pools_queries(blocks[b]))]  # a pooling block's keys are the grid before

    def head_on(self, tokens: Tensor) -> Tensor:
        """The final norm, then the model's head, on (B, prefix + N, C) tokens."""
        return self.model.forward_head(self.model.norm(tokens))

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        conv = self.model.patch_embed.proj
        tokens = token_set(conv_grid(input_size, conv.kernel_size, conv.stride, conv.padding), self.prefix)
        chain: Chain = []
        sets: list[TokenSet] = []
        for s, stage in enumerate(self.model.stages):
            for b, block in enumerate(stage.blocks):
                attn = block.attn
                out = conv_footprint(tokens, attn.pool_q).coarse
                keys = conv_footprint(tokens, attn.pool_v if attn.pool_v is not None else attn.pool_k)
                pool = block.shortcut_pool_attn
                skip = conv_footprint(tokens, pool) if pool is not None else Footprint.identity(tokens)
                stage_in = s - 1 if out != tokens and s > 0 else s
                if b == 0:
                    sets.append(out)
                chain.append(CallSpec(f"stages.{s}.blocks.{b}.attn", tokens, out, full_slots(out),
                                      full_slots(keys.coarse), keys, skip, stage_in, s))
                tokens = out
        return chain, sets


def _pools_queries(block: nn.Module) -> bool:
    """Whether an MViTv2 block pools its queries to a coarser grid (a strided ``pool_q``)."""
    pool = block.attn.pool_q
    return pool is not None and pair(pool.stride) != (1, 1)


# -- TNT ---------------------------------------------------------------------------------------
class TNTAdapter(HierAdapter):
    """timm ``TNT`` (Transformer in Transformer): outer attention over [class] + patches."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.readout = "class" if model.global_pool == "token" else "mean"
        self.token_sites = [f"blocks.{len(model.blocks) - 1}.norm_out"]
        self.fixed_size = tuple(pair(model.pixel_embed.img_size))  # (images are preprocessed to it)
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        return [f"blocks.{b}.attn_out" for b in range(len(self.model.blocks))]  # one grid: every block's

    def legrad_site(self, call: str) -> tuple[str, str]:
        """A block returns (inner, outer) tokens: its outer tokens are the next block's second argument, or the
        final norm's input."""
        b = int(call.split(".")[1])
        return ("norm", "input") if b == len(self.model.blocks) - 1 else (f"blocks.{b + 1}", "arg1")

    def head_on(self, tokens: Tensor) -> Tensor:
        """The final norm, then the model's head, on the (B, 1 + N, C) outer tokens."""
        return self.model.forward_head(self.model.norm(tokens))

    def tail_block(self) -> Any:
        """The last block's ``norm_out`` (whose output is T): its input, the (B, 1 + N, C) outer tokens with the
        inner tokens' projection added, is where the outer half of the block re-runs from (:meth:`tail_run`)."""
        return self.token_sites[-1]

    def tail_run(self, block: Any, x: Tensor, recorded: Any) -> Tensor:
        """The last block's outer half from its (b, 1 + N, C) outer tokens ``x`` (the inner tokens' projection
        already added; the inner tokens reach the outputs only that way): ``u = x + attn_out(norm_out(x))``,
        ``u + mlp(norm_mlp(u))``, as timm's ``Block.forward`` (checked against the model's outputs)."""
        blk = self.model.blocks[-1]
        u = x + blk.drop_path(blk.attn_out(block(x)))
        return u + blk.drop_path(blk.mlp(blk.norm_mlp(u)))

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        patch = pair(self.model.pixel_embed.patch_size)
        tokens = token_set((input_size[0] // patch[0], input_size[1] // patch[1]), 1)
        return [global_call(f"blocks.{b}.attn_out", tokens, 0) for b in range(len(self.model.blocks))], [tokens]


@register_adapter(priority=15, family=HIER)
def _detect_timm_pooling(model: nn.Module) -> Optional[Adapter]:
    if module_family(model, "timm.models.pit") and hasattr(model, "transformers"):
        return PiTAdapter(model)
    if module_family(model, "timm.models.maxxvit") and hasattr(model, "stages"):
        blocks = [blk for st in model.stages for blk in st.blocks]
        kinds = {type(b).__name__ for b in blocks}
        if blocks and kinds <= {"MaxxVitBlock", "MbConvBlock", "ConvNeXtBlock", "TransformerBlock2d"} and (
                kinds & {"MaxxVitBlock", "TransformerBlock2d"}):
            return MaxViTAdapter(model)
        return None  # parallel MaxViT blocks (maxvit_tiny_pm): the CNN adapter's Grad-CAM family
    if module_family(model, "timm.models.levit") and hasattr(model, "stages"):
        return LeViTAdapter(model)
    if module_family(model, "timm.models.mvitv2") and hasattr(model, "stages"):
        return MViTv2Adapter(model)
    if module_family(model, "timm.models.tnt") and hasattr(model, "pixel_embed"):
        return TNTAdapter(model)
    return None
