"""Model adapters: what the Explainer needs to know about a model family.

An adapter never changes the model: it names the modules a method reads (blocks, the last
block's first norm, CNN feature stages), runs the model's own head on tokens when a method
needs a partial forward, and exposes the model's preprocessing and label names.
``adapter_for(model)`` picks the first registered detector that recognises the model.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor, nn

from ..errors import UnsupportedModelError

__all__ = ["Adapter", "register_adapter", "adapter_for"]


class Adapter:
    """Base class of model adapters.

    Attributes:
        model: the wrapped model (never modified).
        family: ``"vit"``, ``"cnn"`` or ``"caption"``.
    """

    family: str = ""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def forward(self, x: Tensor) -> Any:
        """Run the model on a preprocessed (B, 3, H, W) batch; returns its outputs."""
        return self.model(x)

    @property
    def label_names(self) -> Optional[list[str]]:
        """Class names, when the model carries them (zoo models, timm ImageNet models)."""
        cfg = getattr(self.model, "pretrained_cfg", None) or {}
        names = cfg.get("label_names") if isinstance(cfg, dict) else None
        if names:
            return list(names)
        config = getattr(self.model, "config", None)
        id2label = getattr(config, "id2label", None)
        if id2label and not all(str(v).startswith("LABEL_") for v in id2label.values()):
            return [id2label[i] for i in sorted(id2label)]
        return _timm_imagenet_names(self.model)

    def preprocess_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`vitexplain.data.images.preprocess` for this model."""
        from ..data.images import preprocess_kwargs

        return preprocess_kwargs(self.model)

    def describe(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__})"


def _timm_imagenet_names(model: nn.Module) -> Optional[list[str]]:
    cfg = getattr(model, "pretrained_cfg", None)
    if not isinstance(cfg, dict) or not cfg.get("hf_hub_id") and not cfg.get("url"):
        return None
    try:
        from timm.data import ImageNetInfo, infer_imagenet_subset

        subset = infer_imagenet_subset(model)
        if subset is None:
            return None
        names = ImageNetInfo(subset).label_descriptions(as_dict=False)
        return list(names) if len(names) == getattr(model, "num_classes", len(names)) else None
    except Exception:  # label metadata is a convenience, never a failure
        return None


_DETECTORS: list[tuple[int, Callable[[nn.Module], Optional[Adapter]]]] = []


def register_adapter(priority: int = 0) -> Callable:
    """Register ``detect(model) -> Adapter | None``; higher priority is tried first."""

    def decorate(detect: Callable[[nn.Module], Optional[Adapter]]) -> Callable:
        _DETECTORS.append((priority, detect))
        _DETECTORS.sort(key=lambda item: -item[0])
        return detect

    return decorate


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for ``model``.

    Raises:
        UnsupportedModelError: no adapter recognises the model; the message lists the
            supported families.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"expected a torch.nn.Module, got {type(model).__name__}")
    from . import _load_adapters

    _load_adapters()
    for _, detect in _DETECTORS:
        adapter = detect(model)
        if adapter is not None:
            return adapter
    raise UnsupportedModelError(
        f"vitexplain does not know how to explain {type(model).__name__}. Supported: timm "
        "VisionTransformer/DeiT/EVA/BEiT, torchvision VisionTransformer, Hugging Face "
        "ViT/DeiT for image classification, CNNs from timm and torchvision (Grad-CAM, "
        "SE/ECA/CBAM attention gates), the zoo captioner and encoder-decoder captioners. "
        "vx.capture(model) still records the attention of any model using SDPA."
    )
