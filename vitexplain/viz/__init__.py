"""Visualisation: overlays, colormaps, figure grids and PNG writing (all RGB).

Names are imported on first use, so ``import vitexplain.viz`` does not import OpenCV.
"""

from __future__ import annotations

from .._lazy import lazy_attributes

# public name -> submodule that defines it
_LAZY: dict[str, tuple[str, str]] = {
    "overlay": (".overlays", "overlay"),
    "normalize_map": (".overlays", "normalize_map"),
    "apply_colormap": (".colormaps", "apply_colormap"),
    "colormap_lut": (".colormaps", "colormap_lut"),
    "colormap_names": (".colormaps", "colormap_names"),
    "colorbar": (".legend", "colorbar"),
    "with_colorbar": (".legend", "with_colorbar"),
    "readable": (".overlays", "readable"),
    "grid": (".grids", "grid"),
    "save_png": (".grids", "save_png"),
    "channel_tiles": (".channels", "channel_tiles"),
    "caption_figure": (".caption", "caption_figure"),
    "write_gallery": (".gallery", "write_gallery"),
    "render_gallery": (".gallery", "render_gallery"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
