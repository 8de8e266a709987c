"""Hierarchical adapters for more Hugging Face models: LeViT and SAM 2's Hiera image encoder.

- LeViT (``LevitModel``, ``LevitForImageClassification``, ``...WithTeacher``): timm LeViT's chain
  (:class:`~vitexplain.adapters.hier_timm.LeViTAdapter`) with Hugging Face's module names. Each of
  ``encoder.stages[s]`` holds the attention layers on grid s and, at its end, the subsampling
  attention (``LevitAttentionSubsample``: queries on every ``stride``-th row and column, keys over
  the whole grid s, no residual) that produces grid s + 1. The attention is eager (``softmax``).
- SAM 2's image encoder backbone (``Sam2HieraDetModel``): a Hiera that keeps tokens on their
  (H, W) grid (no unrolled order, unlike Hugging Face's ``HieraModel``): windowed attention in
  zero-padded windows (the model's own ``window_partition``) or global attention, and at the
  first block of each pooling stage max-pooled queries (2 x 2 inside each window of the previous
  stage's size) with a max-pooled residual. ``Sam2VisionModel`` and ``Sam2Model`` are refused:
  their FPN neck fuses the feature maps of several stages, so no one readout of the last tokens
  describes what they output; explain their backbone.

Classifiers return their logits; headless models return the mean of their last tokens.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ..layout import pair
from ..methods.families import HIER
from ..methods.resample import CallSpec, Footprint, TokenSet, full_slots
from .base import Adapter, register_adapter
from .hier import Chain, HierAdapter, conv_grid, global_call, module_family, token_set
from .hier_hf import HFForward
from .hier_sam2 import GridHieraAdapter

__all__ = ["HFLeViTAdapter", "HFSam2HieraAdapter"]


# -- LeViT -------------------------------------------------------------------------------------
class HFLeViTAdapter(HFForward, HierAdapter):
    """Hugging Face LeViT: attention layers on one grid per stage, the subsampling attention at
    the end of each stage but the last. The tokens entering a grid's last attention call are the
    output of the layer before it (LeViT's attention has no norm before it), so CDAM's gradient
    there also runs through that layer's residual."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.base = "levit." if hasattr(model, "levit") else ""
        self.stage_modules = model.get_submodule(f"{self.base}encoder.stages")
        self.has_head = not isinstance(getattr(model, "classifier", nn.Identity()), nn.Identity)
        self.fixed_size = pair(model.config.image_size)
        sites: list[Optional[str]] = []
        for s, stage in enumerate(self.stage_modules):
            attention = [j for j, layer in enumerate(stage.layers) if _is(getattr(layer, "module", None), "LevitAttention")]
            if not attention:
                sites.append(None)
            elif attention[-1] > 0:
                sites.append(f"{self.base}encoder.stages.{s}.layers.{attention[-1] - 1}")
            else:
                sites.append(f"{self.base}encoder.stages.{s - 1}" if s > 0 else f"{self.base}patch_embeddings")
        self.token_sites = sites
        self.offer_legrad()

    def _last_layers(self) -> list[tuple[int, bool]]:
        """(index, is attention) of the last stage's layers."""
        stage = self.stage_modules[-1]
        return [(j, _is(getattr(layer, "module", None), "LevitAttention")) for j, layer in enumerate(stage.layers)]

    def legrad_calls(self) -> list[str]:
        """The attention layers of the last stage (no subsampling attention there: it ends the stages before)."""
        s = len(self.stage_modules) - 1
        return [f"{self.base}encoder.stages.{s}.layers.{j}.module" for j, attn in self._last_layers() if attn]

    def legrad_site(self, call: str) -> tuple[str, str]:
        """A call's block is its attention residual layer and the layers after it up to the next attention (its MLP
        residual layer): the output of the last of them."""
        s = len(self.stage_modules) - 1
        j = int(call.rsplit(".", 2)[-2])
        layers = self._last_layers()
        end = next((k - 1 for k, attn in layers if k > j and attn), layers[-1][0])
        return f"{self.base}encoder.stages.{s}.layers.{end}", "output"

    def _last_call_span(self) -> Optional[tuple[int, int]]:
        """(first, last) layer of the last stage's last attention and the layers after it, or None."""
        calls = self.legrad_calls()
        if not calls or self.token_sites[-1] is None:
            return None
        first = int(calls[-1].rsplit(".", 2)[-2])
        return first, int(self.legrad_site(calls[-1])[0].rsplit(".", 1)[-1])

    def tail_block(self) -> Any:
        """The last stage's last attention layer: its input is T (``token_sites[-1]``'s output), and it and the layers
        after it (its MLP) give the tokens the head reads (:meth:`tail_run`)."""
        span = self._last_call_span()
        return None if span is None else f"{self.base}encoder.stages.{len(self.stage_modules) - 1}.layers.{span[0]}"

    def tail_input_is_t(self) -> bool:
        return True

    def tail_run(self, block: Any, x: Tensor, recorded: Any) -> Tensor:
        """The last attention layer (``block``) and the layers after it, in order, from (b, N, C) tokens ``x``."""
        first, last = self._last_call_span()
        for layer in self.stage_modules[-1].layers[first : last + 1]:
            x = layer(x)
        return x

    def tail_refusal(self) -> str:
        from .hier_timm import _LEVIT_TAIL

        return _LEVIT_TAIL.format(type(self.model).__name__)

    def head_on(self, tokens: Tensor) -> Tensor:
        """The mean over the (B, N, C) tokens, then the classifier (BatchNorm1d, linear; with teacher: the mean of
        the classifier and the distillation classifier); headless: that mean, as :meth:`forward` reads it."""
        pooled = tokens.mean(dim=1)
        classifier = getattr(self.model, "classifier", None)
        if classifier is None:
            return pooled
        distill = getattr(self.model, "classifier_distill", None)
        return classifier(pooled) if distill is None else (classifier(pooled) + distill(pooled)) / 2

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        grid = pair(input_size)
        embed = self.model.get_submodule(f"{self.base}patch_embeddings")
        for conv in (m for m in embed.modules() if isinstance(m, nn.Conv2d)):
            grid = conv_grid(grid, conv.kernel_size, conv.stride, conv.padding)
        tokens = token_set(grid)
        chain: Chain = []
        sets: list[TokenSet] = [tokens]
        for s, stage in enumerate(self.stage_modules):
            for j, layer in enumerate(stage.layers):
                name = f"{self.base}encoder.stages.{s}.layers.{j}"
                if _is(getattr(layer, "module", None), "LevitAttention"):
                    chain.append(global_call(f"{name}.module", tokens, s))
                elif _is(layer, "LevitAttentionSubsample"):
                    stride = int(layer.queries_subsample.stride)
                    coarse = token_set(tuple((g - 1) // stride + 1 for g in tokens.grid))
                    chain.append(CallSpec(name, tokens, coarse, full_slots(coarse), full_slots(tokens),
                                          Footprint.identity(tokens), None, s, s + 1))
                    tokens = coarse
                    sets.append(tokens)
        return chain, sets


# -- SAM 2 (Hiera with windows on the grid) ------------------------------------------------------
class HFSam2HieraAdapter(GridHieraAdapter):
    """Hugging Face ``Sam2HieraDetModel`` (SAM 2's image encoder backbone): SAM 2's Hiera
    (:class:`~vitexplain.adapters.hier_sam2.GridHieraAdapter`) with Hugging Face's names; headless, its
    readout is the mean of the last tokens (``last_hidden_state``)."""

    norm_name = "layer_norm1"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.has_head = False
        self.fixed_size = pair(model.config.image_size)
        self.offer_legrad()

    def head_on(self, tokens: Tensor) -> Tensor:
        """On a block's (B, H, W, C) output: the mean over the grid, the embedding :meth:`forward` scores (the model
        has no norm after its last block)."""
        return tokens.mean(dim=(1, 2))

    def window(self, block: nn.Module) -> tuple[int, int]:
        return pair(block.window_size)

    def stride(self, block: nn.Module) -> Optional[tuple[int, int]]:
        return pair(block.query_stride) if block.query_stride else None

    def embed_grid(self, input_size: tuple[int, int]) -> tuple[int, int]:
        conv = self.model.patch_embed.projection
        return conv_grid(input_size, conv.kernel_size, conv.stride, conv.padding)

    def forward(self, x: Tensor) -> Any:
        return self.model(pixel_values=x, return_dict=True).last_hidden_state.mean(dim=(1, 2))


_SAM2_NECK = (
    "{name} is not supported: {what}FPN neck fuses the feature maps of several backbone stages (a lateral 1 x 1 conv "
    "of each, plus the coarser level upsampled), so the maps it outputs do not come from one readout of the last "
    "stage's tokens, which is how rollout, generic and the token methods read a hierarchical model. Explain its "
    "Hiera backbone instead, vx.Explainer({backbone}) (a Sam2HieraDetModel, headless: pass "
    "target=vx.targets.norm(), vx.targets.similarity(vector) or a callable score of the mean of its last tokens), "
    "or record its attention with vx.capture(model)")


def _is(module: Optional[nn.Module], name: str) -> bool:
    return module is not None and type(module).__name__ == name


@register_adapter(priority=15, family=HIER)
def _detect_hf_hier_more(model: nn.Module) -> Optional[Adapter]:
    name = type(model).__name__
    levit = ("LevitModel", "LevitForImageClassification", "LevitForImageClassificationWithTeacher")
    if module_family(model, "transformers.models.levit.") and name in levit:
        return HFLeViTAdapter(model)
    if not module_family(model, "transformers.models.sam2."):
        return None
    if name == "Sam2HieraDetModel":
        return HFSam2HieraAdapter(model)
    if name == "Sam2VisionModel":
        raise UnsupportedModelError(_SAM2_NECK.format(name=name, what="its ", backbone="model.backbone"))
    if name == "Sam2Model":
        raise UnsupportedModelError(_SAM2_NECK.format(
            name=name, what="its output is masks decoded from prompts, and its image encoder's ",
            backbone="model.vision_encoder.backbone"))
    return None
