"""Hugging Face ViTs: one table of model types (prefix tokens, norm names, readout, head).

Each entry of :data:`HF_TYPES` says, for one ``config.model_type``, how many prefix tokens
precede the patches (register tokens are added from ``config.num_register_tokens``), the
name of the layers' first norm, which token(s) the model reads out, and how the model turns
the last layer's output tokens into logits (classifiers) or into its pooled embedding
(headless backbones such as ``ViTModel``, ``Dinov2Model``, ``CLIPVisionModel``,
``SiglipVisionModel``, and the image side of the dual encoders ``CLIPModel`` / ``SiglipModel``,
whose embedding is ``get_image_features``'s). The "tower" is the module that owns the layers and the final
norms (``ViTModel``, ``CLIPVisionTransformer``, ...). Each head is written from the model's
own code and is checked at run time against the model's outputs before a method uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from ..layout import TokenLayout, pair
from ..methods.families import VIT
from .base import Adapter, classifies, register_adapter
from .vit import ViTAdapter

__all__ = ["HFViTAdapter", "HFType", "HF_TYPES"]

Head = Callable[[nn.Module, nn.Module, Tensor], Tensor]
"""``(model, tower, tokens) -> Tensor``: tokens are the last layer's output (B, N, D)."""

# image processor settings: mean, std, crop_pct, interpolation
_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 224 / 256, "bicubic")
_HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 1.0, "bilinear")
_BEIT_STATS = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 1.0, "bicubic")
_IMAGENET_RESIZE = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 1.0, "bilinear")  # ViTImageProcessor with ImageNet stats
_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711), 1.0, "bicubic")


@dataclass(frozen=True)
class HFType:
    """How vitexplain reads one Hugging Face model type.

    Attributes:
        prefix: class (and distillation) tokens before the patches (registers excluded).
        norm1: attribute name of each layer's first norm.
        readout: ``"class"`` or ``"mean"``, or a function of the model returning one.
        logits: the classifier on the last layer's tokens (for ``*ForImageClassification``).
        pooled: the pooled embedding of the headless model on the last layer's tokens.
        stats: (mean, std, crop_pct, interpolation) of the model's image processor.
    """

    prefix: int
    norm1: str
    readout: Any
    logits: Optional[Head]
    pooled: Head
    stats: tuple = _HALF


def _vit_logits(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    s = tower.layernorm(t)
    if hasattr(model, "cls_classifier"):  # DeiTForImageClassificationWithTeacher
        return (model.cls_classifier(s[:, 0]) + model.distillation_classifier(s[:, 1])) / 2
    return model.classifier(s[:, 0])


def _vit_pooled(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    s = tower.layernorm(t)
    pooler = getattr(tower, "pooler", None)
    return pooler(s) if pooler is not None else s[:, 0]


def _dinov2_logits(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    s = tower.layernorm(t)
    patches = s[:, 1 + int(getattr(model.config, "num_register_tokens", 0) or 0) :]
    return model.classifier(torch.cat([s[:, 0], patches.mean(dim=1)], dim=1))


def _dinov2_pooled(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    return tower.layernorm(t)[:, 0]


def _beit_logits(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    return model.classifier(_vit_pooled(model, tower, t))


def _deit_readout(model: nn.Module) -> str:
    """DeiT with teacher averages its class head's and distillation head's logits: both prefix rows are read."""
    return "prefix" if hasattr(model, "cls_classifier") else "class"


def _beit_readout(model: nn.Module) -> str:
    return "mean" if getattr(model.config, "use_mean_pooling", False) else "class"


def _mean_logits(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    return model.classifier(tower.layernorm(t).mean(dim=1))  # IJepaForImageClassification: no class token


def _ijepa_pooled(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    s = tower.layernorm(t)
    pooler = getattr(tower, "pooler", None)  # IJepaPooler reads the first token, a patch (no class token)
    return pooler(s) if pooler is not None else s.mean(dim=1)


def _dinov3_pooled(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    return model.norm(t)[:, 0]  # DINOv3ViTModel: the final norm sits on the model, its layers in model.model


def _aimv2_pooled(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    s = tower.rms_norm(t)  # Aimv2VisionModel: an attention-pooling head (a learned query), else none (the mean)
    return tower.head(s) if getattr(tower, "use_head", False) else s.mean(dim=1)


def _clip_pooled(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    pooled = tower.post_layernorm(t[:, 0])
    projection = getattr(model, "visual_projection", None)  # CLIPVisionModelWithProjection
    return projection(pooled) if projection is not None else pooled


def _clip_logits(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    return model.classifier(t[:, 1:].mean(dim=1))  # CLIPForImageClassification: no final norm


def _clip_readout(model: nn.Module) -> str:
    return "mean" if hasattr(model, "classifier") else "class"


def _siglip_pooled(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    s = tower.post_layernorm(t)
    return tower.head(s) if getattr(tower, "use_head", False) else s.mean(dim=1)


def _siglip_logits(model: nn.Module, tower: nn.Module, t: Tensor) -> Tensor:
    return model.classifier(tower.post_layernorm(t).mean(dim=1))


_VIT = HFType(1, "layernorm_before", "class", _vit_logits, _vit_pooled)
_BEIT = HFType(1, "layernorm_before", _beit_readout, _beit_logits, _vit_pooled, _BEIT_STATS)
_DINO = HFType(1, "norm1", "class", _dinov2_logits, _dinov2_pooled, _IMAGENET)
_CLIP_TYPE = HFType(1, "layer_norm1", _clip_readout, _clip_logits, _clip_pooled, _CLIP)
_SIGLIP = HFType(0, "layer_norm1", "mean", _siglip_logits, _siglip_pooled, _BEIT_STATS)

#: ``config.model_type`` -> how to read it (one table for every Hugging Face ViT).
HF_TYPES: dict[str, HFType] = {
    "vit": _VIT,
    "deit": HFType(2, "layernorm_before", _deit_readout, _vit_logits, _vit_pooled, _IMAGENET),
    "vit_msn": HFType(1, "layernorm_before", "class", _vit_logits, _vit_pooled, _IMAGENET_RESIZE),
    "ijepa": HFType(0, "layernorm_before", "mean", _mean_logits, _ijepa_pooled, _IMAGENET_RESIZE),
    "dinov2": _DINO,
    "dinov3_vit": HFType(1, "norm1", "class", None, _dinov3_pooled, _IMAGENET_RESIZE),
    "dinov2_with_registers": _DINO,
    "beit": _BEIT,
    "data2vec-vision": _BEIT,
    "clip_vision_model": _CLIP_TYPE,
    "clip": _CLIP_TYPE,
    "metaclip_2_vision_model": _CLIP_TYPE,
    "metaclip_2": _CLIP_TYPE,
    "siglip_vision_model": _SIGLIP,
    "aimv2_vision_model": HFType(0, "rms_norm1", "mean", None, _aimv2_pooled, _CLIP),
    "siglip": _SIGLIP,
    "blip_vision_model": HFType(1, "layer_norm1", "class", None, _clip_pooled, _CLIP),
    "git_vision_model": HFType(1, "layer_norm1", "class", None, _clip_pooled, _CLIP),
}


def _vision_config(model: nn.Module) -> Any:
    config = model.config
    return getattr(config, "vision_config", None) or config


class HFViTAdapter(ViTAdapter):
    """A Hugging Face ViT classifier or headless backbone of a type in :data:`HF_TYPES`.

    Args:
        model: the model.
        kind: its entry of :data:`HF_TYPES`.
        blocks: module names of its layers, input side first.
        tower: module name of the module owning the layers and the final norms.
    """

    def __init__(self, model: nn.Module, kind: HFType, blocks: list[str], tower: str) -> None:
        super().__init__(model)
        self.kind = kind
        self.blocks = blocks
        self.norm1 = f"{blocks[-1]}.{kind.norm1}"
        self.tower = tower
        # the model's output is its classifier's (logits; built with num_labels=0 the classifier is nn.Identity and its
        # "logits" are the pooled features: then it has no head, a class index of them is no class)
        self.classifier_out = kind.logits is not None and (hasattr(model, "classifier") or hasattr(model, "cls_classifier"))
        self.has_head = self.classifier_out and classifies(getattr(model, "classifier", None) or model.cls_classifier)
        self.dual = _dual(model)  # CLIPModel / SiglipModel: the image tower of an image-text model
        # called without interpolate_pos_encoding: position embeddings for the configured size only
        self.fixed_size = pair(_vision_config(model).image_size)
        tower_module = model.get_submodule(tower)
        if not self.classifier_out and getattr(tower_module, "use_head", False) and isinstance(
                getattr(tower_module, "head", None), nn.Module):  # SigLIP's / AIMv2's attention-pooling head
            self.pool_attention = f"{tower}.head" if tower else "head"
        pooler = getattr(tower_module, "pooler", None)
        if not self.classifier_out and kind.prefix == 0 and pooler is not None:  # a headless IJepaModel with its pooler
            why = (f"its pooler ({type(pooler).__name__}) reads the first token, which is a patch (the model has no "
                   "class token), so no readout row of the attention is what it reads (raw, rollout, grad_rollout, "
                   "generic and attention Grad-CAM carry such a row); cdam and the token Grad-CAM read the "
                   "gradient through the pooler itself")
            self.drop_readout_row(why)

    def layout(self, input_size: tuple[int, int]) -> TokenLayout:
        config = _vision_config(self.model)
        patch = pair(config.patch_size)
        size = pair(input_size)
        prefix = self.kind.prefix + int(getattr(config, "num_register_tokens", 0) or 0)
        readout = self.kind.readout if isinstance(self.kind.readout, str) else self.kind.readout(self.model)
        if self.pool_attention is not None:
            readout = "pool"
        grid = (size[0] // patch[0], size[1] // patch[1])
        return TokenLayout(prefix, grid, self.kind.prefix > 0, readout, patch_size=patch)

    def forward(self, x: Tensor) -> Any:
        if self.dual:  # the model's own forward needs text; its image embedding is get_image_features'
            features = self.model.get_image_features(pixel_values=x, return_dict=True)
            return features if isinstance(features, Tensor) else features.pooler_output
        out = self.model(pixel_values=x, return_dict=True)  # a config's return_dict=False gives tuples
        if self.classifier_out:
            return out.logits
        embeds = getattr(out, "image_embeds", None)
        if embeds is not None:
            return embeds
        if getattr(out, "pooler_output", None) is not None:
            return out.pooler_output
        # no pooler: the tokens are already normalised, so pool them the way head() does
        hidden = out.last_hidden_state
        return hidden[:, 0] if self.kind.prefix else hidden.mean(dim=1)

    def head(self, tokens: Tensor) -> Tensor:
        tower = self.model.get_submodule(self.tower)
        if self.classifier_out:
            return self.kind.logits(self.model, tower, tokens)  # type: ignore[misc]
        return self.kind.pooled(self.model, tower, tokens)

    def preprocess_kwargs(self) -> dict[str, Any]:
        size = pair(_vision_config(self.model).image_size)
        mean, std, crop_pct, interpolation = self.kind.stats
        return dict(input_size=size, mean=mean, std=std, crop_pct=crop_pct, interpolation=interpolation)


def _dual(model: nn.Module) -> bool:
    """Whether ``model`` is an image-text dual encoder (``CLIPModel``, ``SiglipModel``)."""
    return isinstance(getattr(model, "vision_model", None), nn.Module) and isinstance(
        getattr(model, "text_model", None), nn.Module) and hasattr(model, "get_image_features")


def _layers(model: nn.Module, norm1: str) -> Optional[tuple[list[str], str]]:
    """(layer names, tower name) of the first ModuleList whose children all have ``norm1``
    (in a dual encoder, its vision tower's: the text tower's layers come first and have it too)."""
    within = "vision_model." if _dual(model) else ""
    for name, module in model.named_modules():
        if not name.startswith(within):
            continue
        if isinstance(module, nn.ModuleList) and len(module) and all(hasattr(c, norm1) for c in module):
            parent = name.rpartition(".")[0] if "." in name else ""
            if parent == "encoder" or parent.endswith(".encoder"):
                parent = parent.rpartition(".")[0] if "." in parent else ""
            return [f"{name}.{i}" for i in range(len(module))], parent
    return None


@register_adapter(priority=5, family=VIT)
def _detect_hf(model: nn.Module) -> Optional[Adapter]:
    config = getattr(model, "config", None)
    kind = HF_TYPES.get(getattr(config, "model_type", None))  # type: ignore[arg-type]
    if kind is None:
        return None
    found = _layers(model, kind.norm1)
    if found is None:
        return None
    adapter = HFViTAdapter(model, kind, *found)
    if any(c.__name__ == "BackboneMixin" for c in type(model).__mro__):  # Dinov2Backbone, DINOv3ViTBackbone, ...
        name = type(model).__name__  # (its token layout stays known: vx.capture(model) reads it)
        adapter.drop_all(
            f"{name} is a backbone: it returns feature maps of several stages (for a detection or segmentation "
            "head), not logits or one pooled embedding a target could score; load the same weights as "
            f"{name.replace('Backbone', 'Model')} (or its *ForImageClassification) and explain that, or record "
            "the backbone's attention with vx.capture(model)")
    return adapter
