"""vitexplain: explain vision models while they run their fused attention.

``import vitexplain as vx`` is light: names are imported on first use, so the import
itself pulls in neither OpenCV, matplotlib nor transformers (nor timm).

Public surface (stable names)::

    vx.capture(model, grads=False)      # scoped recorder of attention calls
    vx.Explainer(model).explain(x, method="cdam")
    vx.overlay(image, map)              # (H, W, 3) uint8 RGB
    vx.explore(model, images, out="explore.html")   # one self-contained interactive page
    vx.load_image(path)                 # (H, W, 3) uint8 RGB, raises vx.ImageLoadError
    vx.token_layout(model, (H, W))      # prefix tokens and patch grid
    vx.threads.limit()                  # torch threads for a shared CPU (see vitexplain.threads)
    vx.zoo, vx.data, vx.metrics, vx.methods, vx.targets, vx.viz
"""

from __future__ import annotations

from ._lazy import lazy_attributes
from .errors import (
    CaptureError,
    ConvergenceWarning,
    ImageLoadError,
    InputError,
    NoAttentionError,
    NotFoundError,
    NumericalError,
    OptionError,
    TargetError,
    UnsupportedMethodError,
    UsageError,
    UnsupportedModelError,
    UnrecordedAttentionWarning,
    VitexplainError,
)

__version__ = "0.1.0"

# name -> (module, attribute); attribute None means the module itself.
_LAZY: dict[str, tuple[str, str | None]] = {
    "capture": ("vitexplain.facade", "capture"),
    "Recorder": ("vitexplain.recording", "Recorder"),
    "AttentionRecord": ("vitexplain.recording", "AttentionRecord"),
    "TokenLayout": ("vitexplain.layout", "TokenLayout"),
    "token_layout": ("vitexplain.facade", "token_layout"),
    "Explainer": ("vitexplain.explainer", "Explainer"),
    "Explanation": ("vitexplain.explainer", "Explanation"),
    "overlay": ("vitexplain.viz.overlays", "overlay"),
    "explore": ("vitexplain.explorer", "explore"),
    "load_image": ("vitexplain.data.images", "load_image"),
    "layout": ("vitexplain.layout", None),
    "methods": ("vitexplain.methods", None),
    "metrics": ("vitexplain.metrics", None),
    "targets": ("vitexplain.targets", None),
    "viz": ("vitexplain.viz", None),
    "zoo": ("vitexplain.zoo", None),
    "data": ("vitexplain.data", None),
    "adapters": ("vitexplain.adapters", None),
    "threads": ("vitexplain.threads", None),
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
        "UsageError",
        "OptionError",
        "InputError",
        "NotFoundError",
        "NumericalError",
        "UnrecordedAttentionWarning",
        "ConvergenceWarning",
        "__version__",
    ]
)


__getattr__, _dir = lazy_attributes(__name__, _LAZY)


def __dir__() -> list[str]:
    return __all__
