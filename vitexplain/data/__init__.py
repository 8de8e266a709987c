"""Data: the synthetic shapes benchmark (images, masks, captions) and image loading.

Names are imported on first use so that ``import vitexplain.data`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_LAZY: dict[str, str] = {
    "shapes": ".shapes",
    "ShapesBatch": ".shapes",
    "SHAPES": ".shapes",
    "COLORS": ".shapes",
    "COLOR_RGB": ".shapes",
    "MEAN": ".shapes",
    "STD": ".shapes",
    "normalize": ".shapes",
    "denormalize": ".shapes",
    "load_image": ".images",
    "ImageLoadError": ".images",
    "preprocess": ".images",
    "preprocess_kwargs": ".images",
    "CropBox": ".images",
    "crop_region": ".images",
    "paste_map": ".images",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'vitexplain.data' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    # Importing a submodule binds its name here (the module ``shapes`` would shadow the function
    # ``shapes``), so bind every public name that submodule defines, not only the one asked for.
    for other, source in _LAZY.items():
        if source == _LAZY[name] and hasattr(module, other):
            globals()[other] = getattr(module, other)
    return globals()[name]
