"""Adapters for CNN classifiers: timm, torchvision and any conv net with (B, C) logits.

A CNN adapter names the model's feature stages (input side first); the last one is the
default target layer of Grad-CAM, Grad-CAM++ and LayerCAM. How the stages are found:

- timm: ``model.feature_info`` (the modules ``features_only`` would return), e.g.
  ``layer1..layer4`` for ResNets, ``blocks.N`` for EfficientNet/MobileNet, ``s1..s4`` for RegNet.
- torchvision: ``layer1..layer4`` (ResNet/ResNeXt/Wide-ResNet), ``trunk_output.block1..4``
  (RegNet), and for models with a ``features`` Sequential (MobileNet, EfficientNet, VGG,
  ConvNeXt, ...) the last child of ``features`` before each downsampling child, and the last.
- anything else: the last top-level child holding a ``Conv2d`` before global pooling.

Detectors run after the ViT detectors (priorities 0 and -10 vs 10/5), and accept a model
only when it has ``Conv2d`` modules and no self-attention (``nn.MultiheadAttention`` or a
module class named ``*Attention``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from .base import Adapter, register_adapter
from ..errors import UsageError

__all__ = ["CNNAdapter", "cnn_stages"]

_POOLS = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)


class CNNAdapter(Adapter):
    """A CNN classifier.

    Args:
        model: the CNN (never modified).
        stages: feature stage module names, input side first (default: found automatically,
            see the module docstring).

    Attributes:
        stages: feature stage module names, input side first.
        target_layer: the default layer of the Grad-CAM family (the last stage).
    """

    family = "cnn"

    def __init__(self, model: nn.Module, stages: Optional[Sequence[str]] = None) -> None:
        super().__init__(model)
        self.stages = list(stages) if stages is not None else cnn_stages(model)
        if not self.stages:
            raise UsageError(
                f"no feature stage found in {type(model).__name__}; pass stages=[...] or a layer name"
            )

    @property
    def target_layer(self) -> str:
        """Module name of the last feature stage."""
        return self.stages[-1]

    def describe(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, target_layer={self.target_layer!r})"


def _has(module: nn.Module, kind: type) -> bool:
    return any(isinstance(m, kind) for m in module.modules())


def _is_pool(name: str, module: nn.Module) -> bool:
    return isinstance(module, _POOLS) or type(module).__name__ == "SelectAdaptivePool2d" or name in ("global_pool", "avgpool")


def _max_stride(module: nn.Module) -> int:
    strides = [max(m.stride) if isinstance(m.stride, tuple) else int(m.stride) for m in module.modules() if isinstance(m, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d))]
    return max(strides, default=1)


def _timm_stages(model: nn.Module) -> list[str]:
    info = getattr(model, "feature_info", None)
    if not info:
        return []
    names = []
    for item in info:
        name = item.get("module") if isinstance(item, dict) else None
        if not name:
            return []
        try:
            model.get_submodule(name)
        except AttributeError:
            return []
        names.append(name)
    return names


def _sequence_stages(prefix: str, seq: nn.Sequential) -> list[str]:
    """Last child before each downsampling child, and the last child."""
    children = list(seq.named_children())
    ends = [f"{prefix}.{name}" for (name, _), (_, nxt) in zip(children, children[1:]) if _max_stride(nxt) > 1]
    if children:
        ends.append(f"{prefix}.{children[-1][0]}")
    return list(dict.fromkeys(ends))


def _torchvision_stages(model: nn.Module) -> list[str]:
    if all(hasattr(model, f"layer{i}") for i in range(1, 5)):
        return [f"layer{i}" for i in range(1, 5)]
    trunk = getattr(model, "trunk_output", None)
    if isinstance(trunk, nn.Sequential):
        return [f"trunk_output.{name}" for name, _ in trunk.named_children()]
    features = getattr(model, "features", None)
    if isinstance(features, nn.Sequential):
        return _sequence_stages("features", features)
    return []


def _fallback_stages(model: nn.Module) -> list[str]:
    """The last top-level child holding a Conv2d before the global pooling."""
    last = None
    for name, child in model.named_children():
        if _is_pool(name, child):
            break
        if _has(child, nn.Conv2d):
            last = name
    return [last] if last else []


def cnn_stages(model: nn.Module) -> list[str]:
    """Feature stage module names of a CNN, input side first (see the module docstring)."""
    return _timm_stages(model) or _torchvision_stages(model) or _fallback_stages(model)


def _has_attention(model: nn.Module) -> bool:
    return any(
        isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention") for m in model.modules()
    )


def _is_classifier_cnn(model: nn.Module) -> bool:
    if not _has(model, nn.Conv2d) or _has_attention(model):
        return False
    return callable(getattr(model, "get_classifier", None)) or hasattr(model, "num_classes") or _has(model, nn.Linear)


@register_adapter(priority=0)
def _detect_timm(model: nn.Module) -> Optional[Adapter]:
    if getattr(model, "feature_info", None) and callable(getattr(model, "get_classifier", None)):
        if _is_classifier_cnn(model):
            stages = _timm_stages(model)
            return CNNAdapter(model, stages) if stages else None
    return None


@register_adapter(priority=0)
def _detect_torchvision(model: nn.Module) -> Optional[Adapter]:
    if type(model).__module__.startswith("torchvision.models") and _is_classifier_cnn(model):
        stages = _torchvision_stages(model)
        return CNNAdapter(model, stages) if stages else None
    return None


@register_adapter(priority=-10)
def _detect_generic(model: nn.Module) -> Optional[Adapter]:
    if _is_classifier_cnn(model):
        stages = cnn_stages(model)
        return CNNAdapter(model, stages) if stages else None
    return None
