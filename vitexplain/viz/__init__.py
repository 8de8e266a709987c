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
    "attention_matrix": (".matrix", "attention_matrix"),
    "record_matrix": (".matrix", "record_matrix"),
    "caption_matrix": (".matrix", "caption_matrix"),
    "head_grid": (".matrix", "head_grid"),
    "token_labels": (".matrix", "token_labels"),
    "write_gallery": (".gallery", "write_gallery"),
    "render_gallery": (".gallery", "render_gallery"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
