"""Hierarchical adapters for Hugging Face models: PVTv2, SegFormer (MiT), SAM's and SAM 3's vision encoders, Hiera.

The same chains as timm's (:mod:`vitexplain.adapters.hier`, :mod:`vitexplain.adapters.hier_more`),
read from the Hugging Face module trees: spatial-reduction attention (a strided conv, or adaptive
pooling in PVTv2's linear mode) with overlapping conv patch embeddings between stages; SAM's
windowed and global attention on one grid with a conv neck; Hiera's mask-unit and global
attention in its unrolled token order with max-pooled queries and residuals (the timm adapter's
chain, with Hugging Face's module names and its ``unroll`` function). Classifiers return their
logits; headless models (``PvtV2Model``, ``SegformerModel``, ``SamVisionModel``, ``HieraModel``)
return the mean of their last feature map (Hiera: of its last tokens), the pooled embedding that
``vx.targets.similarity`` / ``vx.targets.norm`` score. Hugging Face LeViT and SAM 2's Hiera backbone:
:mod:`vitexplain.adapters.hier_hf_more`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ..layout import pair
from ..methods.families import HIER
from ..methods.resample import Footprint, TokenSet, Transition
from .base import Adapter, classifies, register_adapter
from .hier import Chain, HierAdapter, conv_footprint, conv_grid, global_call, sam_chain, token_set
from .hier_more import HieraAdapter

__all__ = ["HFSpatialReductionAdapter", "HFSamVisionAdapter", "HFSam3ViTAdapter", "HFHieraAdapter"]


def _keys(attn: nn.Module, tokens: TokenSet, sr_name: str) -> Footprint:
    pool = getattr(attn, "pool", None)
    if isinstance(pool, nn.AdaptiveAvgPool2d):  # PVTv2 linear attention
        return Footprint.adaptive(tokens, token_set(pair(pool.output_size)))
    sr: Optional[nn.Module] = attn
    for part in sr_name.split("."):
        sr = getattr(sr, part, None) if sr is not None else None
    return conv_footprint(tokens, sr if isinstance(sr, nn.Conv2d) else None)


class HFForward:
    """Logits for classifiers; the mean of the last feature map for headless models."""

    model: nn.Module
    has_head: bool

    def forward(self, x: Tensor) -> Any:
        out = self.model(pixel_values=x, return_dict=True)  # a config's return_dict=False gives tuples
        logits = getattr(out, "logits", None)
        if logits is not None:
            return logits
        hidden = out.last_hidden_state
        return hidden.mean(dim=(2, 3)) if hidden.dim() == 4 else hidden.mean(dim=1)


class HFSpatialReductionAdapter(HFForward, HierAdapter):
    """Hugging Face ``PvtV2Model`` / ``PvtV2ForImageClassification`` and ``SegformerModel`` /
    ``SegformerForImageClassification``: stages of an overlapping conv patch embedding and
    blocks of spatial-reduction attention; the classifier averages the last stage."""

    def __init__(self, model: nn.Module, stages: str, embed: str, sr_name: str, norm: str) -> None:
        super().__init__(model)
        self.stages_name, self.embed, self.sr_name = stages, embed, sr_name
        self.stage_modules = model.get_submodule(stages)
        self.token_sites = [f"{stages}.{s}.blocks.{len(st.blocks) - 1}.{norm}" for s, st in enumerate(self.stage_modules)]
        self.has_head = classifies(getattr(model, "classifier", None))  # (num_labels=0: nn.Identity, features)
        size = getattr(model.config, "image_size", None)
        self.fixed_size = None if size is None else pair(size)
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        last = len(self.stage_modules) - 1
        return [f"{self.stages_name}.{last}.blocks.{b}.attention" for b in range(len(self.stage_modules[last].blocks))]

    def head_on(self, tokens: Tensor) -> Tensor:
        """The last stage's norm, the mean over the tokens, then the classifier (headless: that mean, as
        :meth:`forward` reads it), on (B, N, C) tokens. The classifiers average rows of ``hidden_sizes[-1]``
        values of the row-major (H, W, C) tokens, as their own code reshapes them (the tokens' mean when C is
        that size)."""
        normed = self.stage_modules[-1].layer_norm(tokens)
        head = getattr(self.model, "classifier", None)
        if head is None:
            return normed.mean(dim=1)
        return head(normed.reshape(normed.shape[0], -1, int(self.model.config.hidden_sizes[-1])).mean(dim=1))

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        chain: Chain = []
        sets: list[TokenSet] = []
        tokens: Optional[TokenSet] = None
        for s, stage in enumerate(self.stage_modules):
            conv = stage.get_submodule(self.embed)
            if tokens is None:
                tokens = token_set(conv_grid(input_size, conv.kernel_size, conv.stride, conv.padding))
            else:
                down = conv_footprint(tokens, conv)
                chain.append(Transition(down, s - 1, s, f"{self.stages_name}.{s}.{self.embed}"))
                tokens = down.coarse
            sets.append(tokens)
            for b, block in enumerate(stage.blocks):
                chain.append(global_call(f"{self.stages_name}.{s}.blocks.{b}.attention", tokens, s,
                                         _keys(block.attention, tokens, self.sr_name)))
        return chain, sets


class HFSamVisionAdapter(HFForward, HierAdapter):
    """Hugging Face ``SamVisionModel`` (SAM's image encoder, headless), also as ``SamModel.vision_encoder``
    (``SamVisionEncoder``) and SAM-HQ's (``SamHQVisionModel``, ``SamHQVisionEncoder``): windowed (zero-padded)
    and global attention on one patch grid, then the neck (its 3 x 3 conv a transition)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.encoder = "vision_encoder" if hasattr(model, "vision_encoder") else ""
        prefix = f"{self.encoder}." if self.encoder else ""
        self.prefix = prefix
        enc = model.get_submodule(self.encoder) if self.encoder else model
        self.enc = enc
        self.token_sites = [f"{prefix}layers.{len(enc.layers) - 1}.layer_norm1"]
        self.has_head = False
        self.fixed_size = pair(model.config.image_size)
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        """Every layer's attention (windowed or global: all on the one grid)."""
        return [f"{self.prefix}layers.{i}.attn" for i in range(len(self.enc.layers))]

    def head_on(self, tokens: Tensor) -> Tensor:
        """On a layer's (B, H, W, C) output: the neck (convs and channel norms), then the mean over the feature map,
        as :meth:`forward` reads it."""
        return self.enc.neck(tokens).mean(dim=(2, 3))

    def site_grid(self, stage: int, output: Tensor, input_size: Sequence[int]) -> Tensor:
        return output  # (B, H, W, C)

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        conv = self.enc.patch_embed.projection
        tokens = token_set(conv_grid(input_size, conv.kernel_size, conv.stride, conv.padding))
        calls = [(f"{self.prefix}layers.{i}.attn", int(getattr(layer, "window_size", 0) or 0), 1)
                 for i, layer in enumerate(self.enc.layers)]
        neck = [(f"{self.prefix}neck.{name}", layer) for name, layer in self.enc.neck.named_children()]
        return sam_chain(tokens, calls, neck), [tokens]


class HFSam3ViTAdapter(HFForward, HierAdapter):
    """Hugging Face ``Sam3ViTModel`` (SAM 3's image encoder backbone, headless): windowed (zero-padded) and
    global attention with rotary positions on one patch grid, no neck (the FPN neck is ``Sam3VisionModel``'s);
    the pooled embedding is the mean of its output tokens. Heads stay a dimension of its SDPA calls."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.token_sites = [f"layers.{len(model.layers) - 1}.layer_norm1"]
        self.has_head = False
        self.fixed_size = pair(model.config.image_size)  # its rotary positions are built for that grid
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        """Every layer's attention (windowed or global: all on the one grid)."""
        return [f"layers.{i}.attention" for i in range(len(self.model.layers))]

    def head_on(self, tokens: Tensor) -> Tensor:
        """On a layer's (B, H, W, C) output: the mean over the grid, the embedding :meth:`forward` scores (the model
        has no norm after its last layer)."""
        return tokens.mean(dim=(1, 2))

    def site_grid(self, stage: int, output: Tensor, input_size: Sequence[int]) -> Tensor:
        return output  # (B, H, W, C)

    def preprocess_kwargs(self) -> dict[str, Any]:
        # Sam3ImageProcessor: resized to the model's size (whole: pass crop=False to keep all of a non-square
        # image), bilinear, mean and std 0.5
        return {**super().preprocess_kwargs(), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "crop_pct": 1.0,
                "interpolation": "bilinear"}

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        conv = self.model.embeddings.patch_embeddings.projection
        tokens = token_set(conv_grid(input_size, conv.kernel_size, conv.stride, conv.padding))
        calls = [(f"layers.{i}.attention", int(getattr(layer, "window_size", 0) or 0), 1)
                 for i, layer in enumerate(self.model.layers)]
        return sam_chain(tokens, calls, []), [tokens]


class HFHieraAdapter(HFForward, HieraAdapter):
    """Hugging Face ``HieraModel`` / ``HieraForImageClassification``: timm Hiera's chain
    (:class:`~vitexplain.adapters.hier_more.HieraAdapter`) on the layers of
    ``encoder.stages``; the unrolled order is Hugging Face's own ``unroll`` run on token indices.
    The classifier averages the last tokens (then a LayerNorm and the linear head)."""

    norm_name = "layernorm_before"
    windows_always = True  # Hugging Face keeps the window dimension (of size 1) in global attention

    def __init__(self, model: nn.Module) -> None:
        self.base = "hiera." if hasattr(model, "hiera") else ""
        super().__init__(model)
        self.has_head = isinstance(getattr(model, "classifier", None), nn.Linear)

    def _block_names(self) -> list[str]:
        stages = self.model.get_submodule(f"{self.base}encoder.stages")
        return [f"{self.base}encoder.stages.{s}.layers.{i}"
                for s, st in enumerate(stages) for i in range(len(st.layers))]

    def _q_stride(self, attn: nn.Module) -> int:
        return int(attn.query_stride)

    def _widens(self, block: nn.Module) -> bool:
        return block.hidden_size != block.hidden_size_output

    def head_on(self, tokens: Tensor) -> Tensor:
        """On (B, N, C) last-stage tokens (any order): the classifier's pooler (the mean over the tokens, then its
        LayerNorm) and linear classifier; headless: the tokens' mean, as :meth:`forward` reads it."""
        classifier = getattr(self.model, "classifier", None)
        if classifier is None:
            return tokens.mean(dim=1)
        return classifier(self.model.hiera.pooler(tokens))

    def _pool_stride(self) -> tuple[int, int]:
        return pair(self.model.config.query_stride)

    def _fixed_size(self) -> Optional[tuple[int, ...]]:
        return pair(self.model.config.image_size)

    def _unrolled(self, input_size: tuple[int, int]) -> tuple[tuple[int, int], Tensor]:
        from transformers.models.hiera.modeling_hiera import unroll

        config = self.model.config
        hiera = self.model.get_submodule(self.base[:-1]) if self.base else self.model
        grid = (input_size[0] // int(config.patch_stride[0]), input_size[1] // int(config.patch_stride[1]))
        n = grid[0] * grid[1]
        order = unroll(torch.arange(n, dtype=torch.float64).view(1, n, 1), image_shape=tuple(input_size),
                       patch_stride=config.patch_stride, schedule=hiera.unroll_schedule)
        return grid, order[0, :, 0].round().long()


def _in(model: nn.Module, package: str) -> bool:
    return any(c.__module__.startswith(f"transformers.models.{package}") for c in type(model).__mro__)


@register_adapter(priority=15, family=HIER)
def _detect_hf_hier(model: nn.Module) -> Optional[Adapter]:
    name = type(model).__name__
    if _in(model, "pvt_v2") and name in ("PvtV2Model", "PvtV2ForImageClassification"):
        base = "pvt_v2." if name.endswith("Classification") else ""
        return HFSpatialReductionAdapter(model, f"{base}encoder.layers", "patch_embedding.proj", "spatial_reduction",
                                         "layer_norm_1")
    if _in(model, "segformer") and name == "SegformerForSemanticSegmentation":
        raise UnsupportedModelError(
            "SegformerForSemanticSegmentation is not supported: its decode head reads the feature maps of all four "
            "stages (each upsampled and fused by an MLP) and outputs per-pixel logits, so relevance carried back "
            "from the last stage's tokens (how rollout, generic and the token methods read a hierarchical model) "
            "would leave out the stages the head reads directly. Explain its encoder instead, "
            "vx.Explainer(model.segformer) (a headless SegformerModel: pass target=vx.targets.norm(), "
            "vx.targets.similarity(vector) or a callable score of its pooled last stage), or record its attention "
            "with vx.capture(model)")
    if _in(model, "segformer") and name in ("SegformerModel", "SegformerForImageClassification"):
        base = "segformer." if name.endswith("Classification") else ""
        return HFSpatialReductionAdapter(model, f"{base}stages", "patch_embeddings.proj",
                                         "sequence_reduction.sequence_reduction", "layernorm_before")
    if name in ("SamModel", "SamHQModel") and (_in(model, "sam.") or _in(model, "sam_hq")):
        raise UnsupportedModelError(
            f"{name} is not supported: its output is masks decoded from prompts, not one readout of its image "
            "encoder's tokens (how rollout, generic and the token methods read a hierarchical model). Explain its "
            "image encoder, SAM's ViT, instead: vx.Explainer(model.vision_encoder) (headless: pass "
            "target=vx.targets.norm(), vx.targets.similarity(vector) or a callable score of the mean of its "
            "output feature map), or record its attention with vx.capture(model)")
    if (_in(model, "sam.") and name in ("SamVisionModel", "SamVisionEncoder")) or (
            _in(model, "sam_hq") and name in ("SamHQVisionModel", "SamHQVisionEncoder")):
        return HFSamVisionAdapter(model)
    if _in(model, "sam3") and name == "Sam3ViTModel":
        return HFSam3ViTAdapter(model)
    if _in(model, "sam3") and name in ("Sam3VisionModel", "Sam3Model"):
        full = name == "Sam3Model"
        raise UnsupportedModelError(
            f"{name} is not supported: {'its output is masks decoded from prompts, and ' if full else ''}its image "
            "encoder's neck builds a feature pyramid (fpn_hidden_states: maps at several scales resampled from the "
            "ViT's last tokens), which is what SAM 3 reads, so no one readout of the ViT's tokens describes it (how "
            "rollout, generic and the token methods read a hierarchical model). Explain its ViT backbone instead, "
            f"vx.Explainer({'model.vision_encoder.backbone' if full else 'model.backbone'}) (a Sam3ViTModel, "
            "headless: pass target=vx.targets.norm(), vx.targets.similarity(vector) or a callable score of the mean "
            "of its output tokens), or record its attention with vx.capture(model)")
    if _in(model, "hiera") and name in ("HieraModel", "HieraForImageClassification"):
        return HFHieraAdapter(model)
    return None
