"""Data: the synthetic shapes benchmark (images, masks, captions), image decoding
(:mod:`.decoding`) and model preprocessing (:mod:`.images`).

Names are imported on first use so that ``import vitexplain.data`` stays light.
"""

from __future__ import annotations

from .._lazy import lazy_attributes

# public name -> submodule that defines it
_LAZY: dict[str, tuple[str, str]] = {
    "shapes": (".synthetic", "shapes"),
    "ShapesBatch": (".synthetic", "ShapesBatch"),
    "SHAPES": (".drawing", "SHAPES"),
    "COLORS": (".drawing", "COLORS"),
    "COLOR_RGB": (".drawing", "COLOR_RGB"),
    "MEAN": (".synthetic", "MEAN"),
    "STD": (".synthetic", "STD"),
    "normalize": (".synthetic", "normalize"),
    "denormalize": (".synthetic", "denormalize"),
    "load_image": (".decoding", "load_image"),
    "ImageLoadError": (".decoding", "ImageLoadError"),
    "preprocess": (".images", "preprocess"),
    "preprocess_kwargs": (".images", "preprocess_kwargs"),
    "CropBox": (".images", "CropBox"),
    "crop_region": (".images", "crop_region"),
    "paste_map": (".images", "paste_map"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
