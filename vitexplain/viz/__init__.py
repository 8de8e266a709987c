"""Visualisation: overlays, colormaps, figure grids and PNG writing (all RGB).

Names are imported on first use, so ``import vitexplain.viz`` does not import OpenCV.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_LAZY: dict[str, str] = {
    "overlay": ".overlay",
    "normalize_map": ".overlay",
    "apply_colormap": ".colormaps",
    "colormap_lut": ".colormaps",
    "colormap_names": ".colormaps",
    "grid": ".grid",
    "save_png": ".grid",
    "channel_tiles": ".channels",
    "caption_figure": ".caption",
    "write_gallery": ".gallery",
    "render_gallery": ".gallery",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'vitexplain.viz' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
