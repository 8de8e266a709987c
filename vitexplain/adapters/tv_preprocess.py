"""How torchvision preprocesses the images of one of its classification CNNs: its weights' eval transform.

timm's data config (the default of every adapter) says 224 px, crop 0.875 and *bicubic* for a model that carries
no ``pretrained_cfg``; torchvision's ``ImageClassification`` preset resizes with *bilinear* interpolation, and some
architectures were trained at another size (Inception v3: resize 342, crop 299; ConvNeXt: resize 236 or 232; the
EfficientNets bicubic at 224-600 px). The weights a model holds are not recorded on it, so they are found from the
architecture: the builders defined in the model's class's module (``torchvision.models.inception`` for
``Inception3``), and among them the one whose weights have as many parameters as the model (``meta["num_params"]``,
counted with the 1000 ImageNet classes), whose ``DEFAULT`` weights' transform is used. A model with another head
(fine-tuned to other classes) matches none: each setting is then the one all that module's builders agree on, else
the preset's default (resize 256, crop 224, bilinear). No weights are loaded or downloaded.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

from torch import nn

__all__ = ["torchvision_preprocess"]


def _settings(transforms: Any) -> Optional[dict[str, Any]]:
    """``functools.partial(ImageClassification, crop_size=..., ...)`` as preprocess keyword arguments, or None when
    the transform is not that preset (e.g. a detection or video transform)."""
    from torchvision.transforms._presets import ImageClassification

    if not isinstance(transforms, functools.partial) or transforms.func is not ImageClassification:
        return None
    defaults = {k: p.default for k, p in inspect.signature(ImageClassification.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    kw = {**defaults, **transforms.keywords}
    crop, resize = int(kw["crop_size"]), int(kw["resize_size"])
    return {"input_size": (crop, crop), "mean": tuple(kw["mean"]), "std": tuple(kw["std"]), "crop_pct": crop / resize,
            "interpolation": str(getattr(kw["interpolation"], "value", kw["interpolation"]))}


@functools.lru_cache(maxsize=None)
def _module_weights(module: str) -> tuple[tuple[int, dict[str, Any]], ...]:
    """(num_params, settings) of the DEFAULT weights of each classification builder defined in ``module``."""
    import torchvision

    out = []
    for name in torchvision.models.list_models(module=torchvision.models):
        builder = torchvision.models.get_model_builder(name)
        if builder.__module__ != module:
            continue
        try:
            weights = torchvision.models.get_model_weights(name).DEFAULT
        except (AttributeError, ValueError):  # a builder without weights
            continue
        settings = _settings(weights.transforms)
        if settings is not None:
            out.append((int(weights.meta.get("num_params", -1)), settings))
    return tuple(out)


def torchvision_preprocess(model: nn.Module) -> Optional[dict[str, Any]]:
    """The preprocessing of torchvision's weights for ``model`` (see the module docstring), or None when ``model``
    is not a torchvision classification model with published weights.

    Returns:
        ``{"input_size": (H, W), "mean", "std", "crop_pct", "interpolation"}``, or only the settings all builders of
        its module agree on, with the preset's defaults for the rest (a model of a size no weights have).
    """
    module = type(model).__module__
    if not module.startswith("torchvision.models.") or module.count(".") != 2:
        return None
    candidates = _module_weights(module)
    if not candidates:
        return None
    count = sum(p.numel() for p in model.parameters())
    matched = [settings for n, settings in candidates if n == count]
    if matched:
        return dict(matched[0])
    from torchvision.transforms._presets import ImageClassification

    preset = _settings(functools.partial(ImageClassification, crop_size=224)) or {}
    return {key: candidates[0][1][key] if all(s[key] == candidates[0][1][key] for _, s in candidates) else value
            for key, value in preset.items()}

