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
    "load_image": ".images",
    "ImageLoadError": ".images",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'vitexplain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
