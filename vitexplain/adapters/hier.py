"""Adapters for hierarchical and pooling transformers (family ``"hier"``): the base class and
timm's spatial-reduction models (PVTv2, Twins) and SAM's image encoder.

A hierarchical adapter describes its model for an input size as a *chain*
(:mod:`vitexplain.methods.resample`): per attention call its input and output token sets,
its window slots and the footprints of its keys and residual path, and between calls the
transitions (patch embeddings, merges, strided convs, necks) with their footprints. It names,
per stage, the module whose output is the tokens entering the stage's last attention call
(``token_sites``: CDAM, token Grad-CAM). It reads the model's own modules (kernel sizes,
strides, windows) and never changes the model.

What the rule leaves out (docs/methods.md, "Hierarchical transformers"): token mixing outside
attention (depthwise convs inside MLPs, Twins' positional conv, MBConv blocks at stride 1) is
taken as token-wise, and a conv or pooling distributes relevance evenly over its footprint.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple, Optional, Sequence, Union

from torch import Tensor, nn

from ..layout import TokenLayout, pair
from ..methods.families import HIER
from ..methods.resample import CallSpec, Footprint, TokenSet, Transition, full_slots, readout, window_slots
from .base import Adapter, register_adapter
from .hier_head import HeadOnTokens

__all__ = ["HierAdapter", "PageView", "conv_grid", "global_call", "token_set", "sam_chain", "PVTv2Adapter", "TwinsAdapter",
           "SamViTAdapter", "module_family", "readout_pool_check"]

Chain = list[Union[CallSpec, Transition]]


class PageView(NamedTuple):
    """A call as the explorer page draws it (:meth:`HierAdapter.page_view`): the rows ``queries``
    (indices into the call's query set) on the token set ``q_set``, the columns ``keys`` (indices
    into its key set) on ``k_set``, labelled as stage ``stage``."""

    queries: Tensor
    q_set: TokenSet
    keys: Tensor
    k_set: TokenSet
    stage: int


def module_family(model: nn.Module, prefix: str) -> bool:
    """Whether the model's class, or a class it derives from, is defined in module ``prefix``."""
    return any(cls.__module__.startswith(prefix) for cls in type(model).__mro__)


#: timm pool types that average the last tokens (``SelectAdaptivePool2d``'s "fast" ones included)
_MEAN_POOLS = ("avg", "fast", "fastavg")


def readout_pool_check(adapter: Adapter) -> None:
    """Withdraw the ``"readout"`` capability from an adapter whose timm model pools its last tokens other
    than by their mean, saying why (``adapter.notes``).

    The attention methods (raw, rollout, grad_rollout, generic; Swin's attention Grad-CAM) start from
    the row the head reads, taken to be the mean of the last tokens; a head built with
    ``global_pool='max'`` (or ``'avgmax'``, or none) reads something else, and their maps would silently
    explain the mean. The token methods (CDAM, token Grad-CAM) and those running the model's own head
    do not depend on it and still apply. The pool type is ``model.head.pool_type`` or
    ``model.head.global_pool.pool_type`` (timm's heads); a model without either keeps the capability.
    """
    head = getattr(adapter.model, "head", None)
    pool = getattr(head, "pool_type", None)
    if pool is None:
        pool = getattr(getattr(head, "global_pool", None), "pool_type", None)
    if pool is None or pool in _MEAN_POOLS:
        return
    adapter.capabilities = adapter.capabilities - {"readout"}
    adapter.notes["readout"] = (
        f"{type(adapter.model).__name__} is built with global_pool={pool!r}: these methods start from the mean of "
        "its last tokens, which only an average pooling head reads; use 'cdam' or 'gradcam' (they read the "
        "gradient of the model's own output), or create the model with global_pool='avg' (timm's default)")


def conv_grid(grid: tuple[int, int], kernel: Any, stride: Any, padding: Any = 0, ceil: bool = False) -> tuple[int, int]:
    """The output grid of a convolution or pooling (PyTorch's size rule)."""
    k, s, p = pair(kernel), pair(stride), pair(padding)
    if ceil:
        return tuple(-(-(g + 2 * pp - kk) // ss) + 1 for g, kk, ss, pp in zip(grid, k, s, p))  # type: ignore[return-value]
    return tuple((g + 2 * pp - kk) // ss + 1 for g, kk, ss, pp in zip(grid, k, s, p))  # type: ignore[return-value]


def conv_footprint(tokens: TokenSet, module: Optional[nn.Module], prefix: Optional[int] = None) -> Footprint:
    """The footprint of a convolution or pooling module applied to the set's grid (the identity when ``module`` is
    None): its output set ``.coarse`` (``prefix`` prefix tokens, default the input's) and the input tokens each
    output token reads."""
    if module is None:
        return Footprint.identity(tokens)
    k, s, p = module.kernel_size, module.stride, module.padding
    coarse = TokenSet(tokens.prefix if prefix is None else prefix, conv_grid(tokens.grid, k, s, p))
    return Footprint.pool(tokens, coarse, k, s, p)


def global_call(name: str, tokens: TokenSet, stage: int, keys: Optional[Footprint] = None,
                out: Optional[TokenSet] = None, skip: Union[Footprint, None, str] = "identity") -> CallSpec:
    """A call whose queries are every token of ``out`` (default: the input set) and whose keys
    are every token of ``keys.coarse`` (default: the input set itself)."""
    out = out or tokens
    keys = keys or Footprint.identity(tokens)
    residual = Footprint.identity(tokens) if skip == "identity" else skip
    return CallSpec(name, tokens, out, full_slots(out), full_slots(keys.coarse), keys, residual,  # type: ignore[arg-type]
                    in_stage=stage, out_stage=stage)


class HierAdapter(HeadOnTokens, Adapter):
    """A hierarchical transformer, described as a chain of attention calls and transitions.

    Attributes:
        readout: the row the head reads on the last token set: ``"mean"`` (average pooling
            over the grid) or ``"class"`` (the class token).
        token_sites: per stage, the module whose output (B, N, C) or (B, H, W, C) is the
            tokens entering the stage's last attention call, or None (no such call).
    """

    family = HIER
    capabilities = frozenset({"grid", "tokens", "attention", "rollout", "readout", "pixels", "lrp"})
    readout = "mean"
    token_sites: list[Optional[str]]

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._built: dict[tuple[int, int], tuple[Chain, list[TokenSet]]] = {}
        self.has_head = int(getattr(model, "num_classes", 1) or 0) > 0
        self.notes["family"] = (
            "a hierarchical model: attention is carried through its token resampling (raw, rollout, grad_rollout, "
            "generic on any stage's grid; cdam and gradcam at any stage; legrad, smooth and integrated CDAM on the "
            "last stage where the adapter knows the head). Attention Grad-CAM reads one readout row on every "
            "block's tokens; it is not offered: use 'generic' or 'grad_rollout' (stage=...), or 'cdam' with stage=..."
        )
        self.notes["head"] = (
            f"vitexplain does not know how {type(model).__name__}'s head reads a block's tokens (LeGrad applies it "
            "to every last-stage block's output); use 'generic' or 'grad_rollout', or 'cdam'")
        readout_pool_check(self)

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        """(chain, first token set of every stage) for an input of ``input_size`` pixels."""
        raise self.not_implemented("build()")

    def _cached(self, input_size: Sequence[int]) -> tuple[Chain, list[TokenSet]]:
        size = pair(input_size)
        if size not in self._built:
            self._built[size] = self.build(size)
        return self._built[size]

    def chain(self, input_size: Sequence[int]) -> Chain:
        """The chain for this input size, input side first."""
        return self._cached(input_size)[0]

    def stage_sets(self, input_size: Sequence[int]) -> list[TokenSet]:
        """The first token set of every stage (stage 0 = the finest grid)."""
        return self._cached(input_size)[1]

    def readout_row(self, tokens: TokenSet, batch: int, device: Any) -> Tensor:
        """The row the head reads on the last token set: (B, n) (see :func:`readout`)."""
        return readout(tokens, batch, device, self.readout)

    def chain_stage(self, stage: int) -> int:
        """The chain stage whose first set a map of ``stage`` is read from (the stage itself)."""
        return stage

    def finish(self, r: Tensor, stage: int, input_size: Sequence[int]) -> Any:
        """A row carried back to ``stage``'s set as maps: (B, H_s, W_s), or (maps, extras)."""
        return self.stage_sets(input_size)[stage].on_grid(r)

    def finish_call(self, spec: CallSpec, r: Tensor, input_size: Sequence[int]) -> Any:
        """A row over a call's input set (``raw``) as maps on that set's grid."""
        return spec.inp.on_grid(r)

    def page_view(self, spec: CallSpec, input_size: Sequence[int]) -> Optional[PageView]:
        """How the explorer page draws a call whose token sets are not image grids (CrossViT's joint
        set), or None: on the call's own query and key sets."""
        return None

    def page_input(self, input_size: Sequence[int]) -> Optional[Tensor]:
        """Indices of the first stage set (``stage_sets()[0]``) in the chain's input set, where the two
        differ (CrossViT: branch 0 of the joint set), or None: the same set. The page's rollout rows
        are drawn on the first stage set."""
        return None

    def site_grid(self, stage: int, output: Tensor, input_size: Sequence[int]) -> Tensor:
        """A token site's output as (B, H_s, W_s, C) on the stage grid (prefix tokens dropped)."""
        tokens = self.stage_sets(input_size)[stage]
        if output.dim() == 4:
            return output
        return output[:, tokens.prefix:].reshape(output.shape[0], *tokens.grid, output.shape[-1])

    def layout(self, input_size: Sequence[int]) -> TokenLayout:
        """The layout of the finest token grid (stage 0), the grid of the default maps."""
        size = pair(input_size)
        first = self.stage_sets(size)[0]
        # the pixels per token, as TokenLayout.for_map reads them: a 30 px side on 8 tokens of a
        # stride-4 embedding (PVTv2's k7 s4 p3) is 4 px each, not 30 // 8 = 3
        stride = (max(1, round(size[0] / first.grid[0])), max(1, round(size[1] / first.grid[1])))
        return TokenLayout(first.prefix, first.grid, first.prefix > 0, self.readout, patch_size=stride)

    def preprocess_kwargs(self) -> dict[str, Any]:
        kwargs = super().preprocess_kwargs()
        size = getattr(self, "fixed_size", None)
        if size is not None:
            kwargs["input_size"] = size
        return kwargs


def token_set(grid: Sequence[int], prefix: int = 0) -> TokenSet:
    """A token set of ``prefix`` tokens and a (gh, gw) grid (ints, whatever the grid's number type)."""
    return TokenSet(prefix, (int(grid[0]), int(grid[1])))


# -- PVTv2 -------------------------------------------------------------------------------------
def _sr_keys(attn: nn.Module, tokens: TokenSet) -> Footprint:
    """The keys' footprint of a spatial-reduction attention (PVTv2, Twins' GSA)."""
    pool = getattr(attn, "pool", None)
    if pool is not None:  # PVTv2 linear: adaptive average pooling, then a 1 x 1 conv
        out = pair(pool.output_size)
        return Footprint.adaptive(tokens, token_set(out))
    return conv_footprint(tokens, getattr(attn, "sr", None))


class PVTv2Adapter(HierAdapter):
    """timm ``PyramidVisionTransformerV2``: overlapping conv patch embeddings between stages,
    spatial-reduction attention (keys and values from a strided conv, or adaptive pooling in
    the linear variant), average pooling."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.token_sites = [f"stages.{s}.blocks.{len(st.blocks) - 1}.norm1" for s, st in enumerate(model.stages)]
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        last = len(self.model.stages) - 1
        return [f"stages.{last}.blocks.{b}.attn" for b in range(len(self.model.stages[last].blocks))]

    def head_on(self, tokens: Tensor) -> Tensor:
        """The last stage's norm, then the model's head: (B, N, C) tokens as (B, C, N, 1) (its mean over the grid is
        the mean over the tokens)."""
        return self.model.forward_head(self.model.stages[-1].norm(tokens).transpose(1, 2)[..., None])

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        conv = self.model.patch_embed.proj
        grid = conv_grid(input_size, conv.kernel_size, conv.stride, conv.padding)
        chain: Chain = []
        sets: list[TokenSet] = []
        tokens = token_set(grid)
        for s, stage in enumerate(self.model.stages):
            if stage.downsample is not None and s > 0:
                down = conv_footprint(tokens, stage.downsample.proj)
                chain.append(Transition(down, s - 1, s, f"stages.{s}.downsample"))
                tokens = down.coarse
            sets.append(tokens)
            for b, block in enumerate(stage.blocks):
                chain.append(global_call(f"stages.{s}.blocks.{b}.attn", tokens, s, _sr_keys(block.attn, tokens)))
        return chain, sets


# -- Twins -------------------------------------------------------------------------------------
class TwinsAdapter(HierAdapter):
    """timm ``Twins`` (PCPVT and SVT): non-overlapping conv patch embeddings per stage,
    global sub-sampled attention (keys from a strided conv), SVT's locally-grouped (windowed)
    attention with zero padding, average pooling. The positional conv after each stage's
    first block is taken as token-wise."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.token_sites = [f"blocks.{s}.{len(st) - 1}.norm1" for s, st in enumerate(model.blocks)]
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        last = len(self.model.blocks) - 1
        return [f"blocks.{last}.{b}.attn" for b in range(len(self.model.blocks[last]))]

    def head_on(self, tokens: Tensor) -> Tensor:
        """The final norm, then the model's head, on (B, N, C) tokens."""
        return self.model.forward_head(self.model.norm(tokens))

    def legrad_modules(self) -> list[str]:
        return super().legrad_modules() + ["norm"]

    def legrad_final(self, recorder: Any, call: str) -> Tensor:
        """The final norm's input: a stage of one block has its positional conv (PEG) after that block."""
        return recorder.activation("norm").input

    def tail_run(self, block: Any, x: Tensor, recorded: Any) -> Tensor:
        """The last block from (b, N, C) tokens ``x`` (its feature size as recorded), then, when it is its stage's
        first block (a one-block last stage), the stage's positional conv (PEG), which runs after a stage's first
        block and before the final norm."""
        out = block(x, *recorded.args[1:], **recorded.kwargs)
        if len(self.model.blocks[-1]) == 1:
            out = self.model.pos_block[-1](out, recorded.args[1])
        return out

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        chain: Chain = []
        sets: list[TokenSet] = []
        tokens: Optional[TokenSet] = None
        size = input_size
        for s, (embed, blocks) in enumerate(zip(self.model.patch_embeds, self.model.blocks)):
            conv = embed.proj
            if tokens is None:
                tokens = token_set(conv_grid(size, conv.kernel_size, conv.stride, conv.padding))
            else:
                down = conv_footprint(tokens, conv)
                chain.append(Transition(down, s - 1, s, f"patch_embeds.{s}"))
                tokens = down.coarse
            sets.append(tokens)
            for b, block in enumerate(blocks):
                attn, name = block.attn, f"blocks.{s}.{b}.attn"
                window = getattr(attn, "ws", None)
                if window is not None and type(attn).__name__ == "LocallyGroupedAttn":
                    slots = window_slots(tokens, pair(window))
                    chain.append(CallSpec(name, tokens, tokens, slots, slots, Footprint.identity(tokens),
                                          Footprint.identity(tokens), s, s))
                else:
                    chain.append(global_call(name, tokens, s, _sr_keys(attn, tokens)))
        return chain, sets


# -- SAM ---------------------------------------------------------------------------------------
class SamViTAdapter(HierAdapter):
    """timm ``VisionTransformerSAM`` (SAM's image encoder, ViT-Det style): windowed attention
    (zero-padded windows) and global attention on one patch grid, then a conv neck (its 3 x 3
    conv is a transition on the same grid), average pooling when it has a head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.token_sites = [f"blocks.{len(model.blocks) - 1}.norm1"]
        self.fixed_size = tuple(pair(model.patch_embed.img_size))
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        return [f"blocks.{b}.attn" for b in range(len(self.model.blocks))]  # one grid: every block's

    def head_on(self, tokens: Tensor) -> Tensor:
        """The conv neck, then the model's head, on (B, H, W, C) tokens."""
        return self.model.forward_head(self.model.neck(tokens.permute(0, 3, 1, 2)))

    def site_grid(self, stage: int, output: Tensor, input_size: Sequence[int]) -> Tensor:
        return output  # SAM's blocks keep tokens as (B, H, W, C)

    def layout(self, input_size: Sequence[int]) -> TokenLayout:
        """The patch grid with the patch's own size in pixels: a cell covers one patch also at a size the
        patch does not divide (which the model refuses: the refusal names the patch, not H / grid)."""
        return replace(super().layout(input_size), patch_size=pair(self.model.patch_embed.patch_size))

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        patch = pair(self.model.patch_embed.patch_size)
        tokens = token_set((input_size[0] // patch[0], input_size[1] // patch[1]))
        # heads are folded into SDPA's batch: (B * nW * heads, n, d)
        calls = [(f"blocks.{b}.attn", int(getattr(block, "window_size", 0) or 0), int(block.attn.num_heads))
                 for b, block in enumerate(self.model.blocks)]
        return sam_chain(tokens, calls, _neck_layers(getattr(self.model, "neck", None))), [tokens]


def _neck_layers(neck: Optional[nn.Module]) -> list[tuple[str, nn.Module]]:
    """(module name, layer) of SAM's neck in order: a Sequential's layers, or the one module timm builds without
    neck channels (``neck_chans=None``, ``samvit_base_patch16_224``: a LayerNorm2d), or none."""
    if neck is None:
        return []
    if isinstance(neck, nn.Sequential):
        return [(f"neck.{k}", layer) for k, layer in enumerate(neck)]
    return [("neck", neck)]


def sam_chain(tokens: TokenSet, calls: Sequence[tuple[str, int, int]], neck: Sequence[tuple[str, nn.Module]]) -> Chain:
    """SAM's image encoder as a chain: windowed (window > 0, zero-padded) and global attention calls
    on one grid, then the neck's convolutions wider than 1 x 1 as transitions.

    Args:
        tokens: the patch grid.
        calls: per attention call (module name, window size or 0, heads folded into its batch).
        neck: the neck's (module name, layer) in order.
    """
    chain: Chain = []
    for name, window, heads in calls:
        slots = window_slots(tokens, (window, window)) if window > 0 else full_slots(tokens)
        identity = Footprint.identity(tokens)
        chain.append(CallSpec(name, tokens, tokens, slots, slots, identity, identity, 0, 0, folded_heads=heads))
    for name, layer in neck:
        if isinstance(layer, nn.Conv2d) and pair(layer.kernel_size) != (1, 1):
            out = token_set(conv_grid(tokens.grid, layer.kernel_size, layer.stride, layer.padding))
            chain.append(Transition(Footprint.pool(tokens, out, layer.kernel_size, layer.stride, layer.padding), 0, 0, name))
            tokens = out
    return chain


@register_adapter(priority=15, family=HIER)
def _detect_timm_hier(model: nn.Module) -> Optional[Adapter]:
    if module_family(model, "timm.models.pvt_v2") and hasattr(model, "stages"):
        return PVTv2Adapter(model)
    if module_family(model, "timm.models.twins") and hasattr(model, "patch_embeds"):
        return TwinsAdapter(model)
    if module_family(model, "timm.models.vision_transformer_sam") and hasattr(model, "blocks"):
        return SamViTAdapter(model)
    return None
