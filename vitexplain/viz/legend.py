"""Colour bars: what the colours of an overlay mean, drawn under it (RGB)."""

from __future__ import annotations

import math
from typing import Optional

import cv2
import numpy as np

from ._util import as_rgb, real, whole
from .colormaps import colormap_lut

__all__ = ["colorbar", "with_colorbar"]

_FONT = cv2.FONT_HERSHEY_SIMPLEX


def _number(value: float) -> str:
    return f"{value:.3g}"


def colorbar(
    width: int,
    *,
    signed: bool,
    scale: Optional[float] = None,
    colormap: Optional[str] = None,
    height: Optional[int] = None,
    low: Optional[float] = None,
) -> np.ndarray:
    """A horizontal colour bar with its end labels, on white.

    Args:
        width: pixels.
        signed: a diverging bar centred at 0 (``-scale``, ``0``, ``+scale``; blue against the
            target, red for it) instead of ``0 .. scale``.
        scale: the value of the top colour: the largest |value| of a signed map, the largest value
            otherwise (None: labels ``max``).
        colormap: the colormap (default: ``"bwr"`` signed, ``"jet"`` otherwise, as
            :func:`vitexplain.viz.overlay`).
        height: pixels of the whole legend, at least 8 (default: from the width, 28 to 44).
        low: the value the bottom colour stands for when not ``signed`` (default 0): the map's minimum
            for an overlay normalised with ``"minmax"``, whose lowest colour is that minimum, not 0.

    Returns:
        (height, width, 3) uint8 RGB.

    Raises:
        UsageError: a width or height that is not a positive whole number of pixels, or a scale that is not a
            finite non-negative number.
    """
    width = whole(width, "colorbar width (pixels)")  # 0 was an OpenCV error, a negative one a NumPy one
    if scale is not None:  # (a NaN scale was written "nan", a negative signed one "--1 against")
        scale = real(scale, "colorbar scale (the value of the top colour)", low=0.0 if signed else -math.inf)
    colormap = colormap or ("bwr" if signed else "jet")
    height = max(28, min(44, width // 8)) if height is None else whole(height, "colorbar height (pixels)", low=8)
    bar_h = max(6, height // 3)
    lut = colormap_lut(colormap)
    idx = np.linspace(0, 255, width).round().astype(int)
    out = np.full((height, width, 3), 255, np.uint8)
    out[2 : 2 + bar_h] = lut[idx][None]
    top = "max" if scale is None else _number(scale)
    bottom = "0" if low is None else _number(real(low, "colorbar low (the value of the bottom colour)"))
    labels = [f"-{top} against", "0", f"+{top} for"] if signed else [bottom, "", top]
    font = max(0.3, min(0.5, width / 700))
    thick = 1
    y = height - 5
    for i, text in enumerate(labels):
        if not text:
            continue
        w = cv2.getTextSize(text, _FONT, font, thick)[0][0]
        x = (0, (width - w) // 2, width - w)[i]
        cv2.putText(out, text, (max(0, x), y), _FONT, font, (40, 40, 40), thick, cv2.LINE_AA)
    return out


def with_colorbar(image: np.ndarray, *, signed: bool, scale: Optional[float] = None, colormap: Optional[str] = None,
                  low: Optional[float] = None) -> np.ndarray:
    """``image`` (H, W, 3) uint8 RGB (or a PIL image) with :func:`colorbar` under it: (H + bar, W, 3) uint8 RGB."""
    image = as_rgb(image)
    bar = colorbar(image.shape[1], signed=signed, scale=scale, colormap=colormap, low=low)
    return np.concatenate([image, bar], axis=0)
