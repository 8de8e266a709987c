"""vitexplain: explain vision models while they run their fused attention.

``import vitexplain as vx`` is light: names are imported on first use, so the import
itself pulls in neither OpenCV, matplotlib nor transformers (nor timm).

Public surface (stable names)::

    vx.capture(model, grads=False)      # scoped recorder of attention calls
    vx.Explainer(model).explain(x, method="cdam")
    vx.overlay(image, map)              # (H, W, 3) uint8 RGB
    vx.load_image(path)                 # (H, W, 3) uint8 RGB, raises vx.ImageLoadError
    vx.token_layout(model, (H, W))      # prefix tokens and patch grid
    vx.zoo, vx.data, vx.metrics, vx.methods, vx.targets, vx.viz
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    CaptureError,
    ImageLoadError,
    NoAttentionError,
    TargetError,
    UnsupportedMethodError,
    UnsupportedModelError,
    VitexplainError,
)

__version__ = "0.1.0"

# name -> (module, attribute); attribute None means the module itself.
_LAZY: dict[str, tuple[str, str | None]] = {
    "capture": ("vitexplain.capture", "capture"),
    "Recorder": ("vitexplain.capture", "Recorder"),
    "AttentionRecord": ("vitexplain.capture", "AttentionRecord"),
    "TokenLayout": ("vitexplain.layout", "TokenLayout"),
    "token_layout": ("vitexplain.layout", "token_layout"),
    "Explainer": ("vitexplain.explainer", "Explainer"),
    "Explanation": ("vitexplain.explainer", "Explanation"),
    "overlay": ("vitexplain.viz.overlay", "overlay"),
    "load_image": ("vitexplain.data.images", "load_image"),
    "layout": ("vitexplain.layout", None),
    "methods": ("vitexplain.methods", None),
    "metrics": ("vitexplain.metrics", None),
    "targets": ("vitexplain.targets", None),
    "viz": ("vitexplain.viz", None),
    "zoo": ("vitexplain.zoo", None),
    "data": ("vitexplain.data", None),
    "models": ("vitexplain.models", None),
}

__all__ = sorted(
    [
        *_LAZY,
        "VitexplainError",
        "NoAttentionError",
        "UnsupportedModelError",
        "UnsupportedMethodError",
        "TargetError",
        "CaptureError",
        "ImageLoadError",
        "__version__",
    ]
)


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'vitexplain' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
