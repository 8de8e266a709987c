"""Hugging Face CNN classifiers (``ResNetForImageClassification``, ConvNeXt, RegNet, BiT, EfficientNet, MobileNet,
and the conv/attention hybrids MobileViT and MobileViTV2).

They are CNNs like timm's and torchvision's (:mod:`vitexplain.adapters.cnn`), with two differences:
the model takes ``pixel_values=`` and returns an ``ImageClassifierOutput`` (the adapter's forward
returns its ``logits``), and the feature stages sit in the base model at a path each model type
names (:data:`HF_CNN_STAGES`): the stage ends are the last block before each downsampling block,
and the last block, as for torchvision's ``features``.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from ..methods.families import CNN
from .base import Adapter, register_adapter
from .cnn import CNNAdapter, calls_attention
from .cnn_stages import stage_ends

__all__ = ["HFCNNAdapter", "HF_CNN_STAGES", "HF_HYBRIDS"]

#: ``config.model_type`` -> the ModuleList of the base model (``model.base_model``) holding its stages or blocks.
HF_CNN_STAGES = {
    "resnet": "encoder.stages",
    "convnext": "encoder.stages",
    "convnextv2": "encoder.stages",
    "regnet": "encoder.stages",
    "bit": "encoder.stages",
    "efficientnet": "encoder.blocks",
    "mobilenet_v1": "layer",
    "mobilenet_v2": "layer",
    "mobilevit": "encoder.layer",  # conv/attention hybrids: the Grad-CAM family on their conv feature maps
    "mobilevitv2": "encoder.layer",
}

#: Types in :data:`HF_CNN_STAGES` whose blocks call attention (explained as conv/attention hybrids, see cnn.py).
HF_HYBRIDS = frozenset({"mobilevit", "mobilevitv2"})


class HFCNNAdapter(CNNAdapter):
    """A Hugging Face CNN image classifier (see the module docstring).

    Args:
        model: the ``*ForImageClassification`` model (never modified).
        stages: feature stage module names, input side first.
    """

    def forward(self, x: Tensor) -> Any:
        return self.model(pixel_values=x, return_dict=True).logits  # (a config's return_dict=False gives tuples)

    def preprocess_kwargs(self) -> dict[str, Any]:
        kwargs = super().preprocess_kwargs()
        size = getattr(self.model.config, "image_size", None)
        model_type = self.model.config.model_type
        if isinstance(size, int):  # EfficientNet and MobileNet configs carry their input size
            kwargs["input_size"] = (size, size)
        if model_type in HF_HYBRIDS:  # MobileViTImageProcessor: pixels in [0, 1], no normalisation, channels flipped
            kwargs.update(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), bgr=True)
            if isinstance(size, int):  # as converted: shortest edge to size + 32, then a center crop
                kwargs["crop_pct"] = size / (size + 32)
        if model_type in ("mobilenet_v1", "mobilenet_v2") and isinstance(size, int):  # their processors, as converted
            # from TensorFlow: shortest edge to size + 32, center crop, bilinear, mean and std 0.5 (pixels in [-1, 1])
            kwargs.update(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=size / (size + 32),
                          interpolation="bilinear")
        if model_type == "efficientnet":  # EfficientNetImageProcessor: resized to the size, no crop (its mean and its
            kwargs["crop_pct"] = 1.0      # std divided in twice, include_top, are ImageNet's statistics)
        if model_type == "bit":  # converted with timm's BiT data config: mean and std 0.5, no crop margin, bilinear
            kwargs.update(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=1.0, interpolation="bilinear")
        return kwargs


def _hf_cnn_stages(model: nn.Module) -> Optional[list[str]]:
    """Stage-end module names of a Hugging Face CNN classifier, or None when it is not one."""
    config = getattr(model, "config", None)
    path = HF_CNN_STAGES.get(getattr(config, "model_type", None))  # type: ignore[arg-type]
    base = getattr(model, "base_model", None)
    if path is None or not isinstance(base, nn.Module) or base is model:
        return None
    prefix = next((name for name, module in model.named_children() if module is base), None)
    try:
        blocks = base.get_submodule(path)
    except AttributeError:
        return None
    if prefix is None or not isinstance(blocks, nn.ModuleList) or not len(blocks):
        return None
    return stage_ends(f"{prefix}.{path}", blocks)


@register_adapter(priority=0, family=CNN)
def _detect_hf_cnn(model: nn.Module) -> Optional[Adapter]:
    model_type = getattr(getattr(model, "config", None), "model_type", None)  # (any model: it may have no config)
    if model_type not in HF_CNN_STAGES or not isinstance(getattr(model, "classifier", None), nn.Module):
        return None
    if model_type not in HF_HYBRIDS and calls_attention(model):
        return None
    stages = _hf_cnn_stages(model)
    return HFCNNAdapter(model, stages) if stages else None
