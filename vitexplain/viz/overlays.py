"""Saliency overlays: a map (any size, numpy or torch) blended over an RGB image.

Colour order is **RGB** everywhere, in and out -- not OpenCV's BGR. Images from
:func:`vitexplain.load_image` (or PIL / matplotlib) can be passed as they are; for an
image read with ``cv2.imread`` use ``img[..., ::-1]`` first.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import cv2
import numpy as np

from ._util import as_rgb, map_to_numpy, real
from .colormaps import apply_colormap, colormap_lut
from ..errors import UsageError

__all__ = ["overlay", "normalize_map", "readable", "MIN_SIDE", "NORMALIZE_MODES", "INTERPOLATIONS"]

#: Normalisation modes of :func:`normalize_map` / :func:`overlay`.
NORMALIZE_MODES: tuple[str, ...] = ("minmax", "percentile", "signed", "none")

#: Map resizing modes (OpenCV flags).
INTERPOLATIONS: dict[str, int] = {
    "nearest": getattr(cv2, "INTER_NEAREST_EXACT", cv2.INTER_NEAREST),  # pixel-centre exact
    "bilinear": cv2.INTER_LINEAR,
    "bicubic": cv2.INTER_CUBIC,
}

#: Shortest side, in pixels, at which overlays of small images are drawn (:func:`readable`).
MIN_SIDE = 256

# Ranges within a few float32 ULPs of the values are noise around a constant.
_REL_TOL = 4 * float(np.finfo(np.float32).eps)


def _flat(lo: float, hi: float) -> bool:
    return hi - lo <= _REL_TOL * max(abs(lo), abs(hi))

ContourSpec = Union[bool, float, Sequence[float]]


def normalize_map(map: Any, mode: str = "minmax") -> np.ndarray:  # noqa: A002
    """Scale a 2-D map to ``[0, 1]`` for colouring.

    Args:
        map: 2-D array or tensor (any device/dtype); leading singleton dims are squeezed.
        mode: ``"minmax"``: ``(m - min) / (max - min)``. ``"percentile"``: clip to the
            1st..99th percentile, then scale (robust to a few hot pixels; falls back to
            ``minmax`` when those percentiles coincide). ``"signed"``: ``0.5 + 0.5 * m /
            max|m|``, so 0 lands on the centre of a diverging colormap, positive values
            above it and negative below, with a symmetric scale. ``"none"``: the values
            are already in ``[0, 1]`` and are used as they are.

    Returns:
        ``(h, w)`` float32 array in ``[0, 1]``. A constant map gives all zeros (``signed``:
        0.5 for an all-zero map, 0 or 1 for a constant negative or positive one).

    Raises:
        ValueError: Unknown mode, a map that is not 2-D, NaN/inf values, or values outside
            ``[0, 1]`` with ``mode="none"``.
    """
    if not isinstance(mode, str):  # (None was read as "none": the values drawn as they are, a faint map for most)
        raise UsageError(f"normalize must be one of {', '.join(NORMALIZE_MODES)} (a string), got "
                         f"{mode!r}; 'minmax' is the default, 'none' draws values already in [0, 1] as they are")
    m = map_to_numpy(map, np.float64)  # (through float32, a float64 map of values below 1e-38 was all zeros)
    key = mode.lower()
    if key == "percentile":
        lo, hi = np.percentile(m, [1.0, 99.0])
        if not _flat(lo, hi):
            return ((np.clip(m, lo, hi) - lo) / (hi - lo)).astype(np.float32)
        key = "minmax"
    if key == "minmax":
        lo, hi = float(m.min()), float(m.max())
        if _flat(lo, hi):
            return np.zeros(m.shape, np.float32)
        return ((m - lo) / (hi - lo)).astype(np.float32)
    if key == "signed":
        s = float(np.abs(m).max())
        if s <= 0.0:
            return np.full(m.shape, 0.5, np.float32)
        return np.clip(0.5 + 0.5 * (m / s), 0.0, 1.0).astype(np.float32)
    if key == "none":
        lo, hi = float(m.min()), float(m.max())
        if lo < -1e-6 or hi > 1 + 1e-6:
            raise UsageError(
                f"normalize='none' needs map values in [0, 1], got [{lo:.4g}, {hi:.4g}]; "
                "use 'minmax', 'percentile' or 'signed'"
            )
        return np.clip(m, 0.0, 1.0).astype(np.float32)
    raise UsageError(f"unknown normalize mode {mode!r}; choose from {', '.join(NORMALIZE_MODES)}")


def _resize(m: np.ndarray, size: tuple[int, int], interpolation: str) -> np.ndarray:
    try:
        flag = INTERPOLATIONS[str(interpolation).lower()]
    except KeyError:
        raise UsageError(
            f"unknown interpolation {interpolation!r}; choose from {', '.join(INTERPOLATIONS)}"
        ) from None
    h, w = size
    if m.shape == (h, w):
        return m
    if flag != INTERPOLATIONS["nearest"] and m.shape[0] >= h and m.shape[1] >= w:
        flag = cv2.INTER_AREA  # shrinking: average instead of aliasing
    return cv2.resize(m, (w, h), interpolation=flag)


def _contour_levels(contour: ContourSpec) -> list[float]:
    """The levels of ``contour``, each in [0, 1] (a level outside drew nothing, silently).

    Raises:
        UsageError: a level that is not a finite number in [0, 1].
    """
    if contour is False or contour is None:
        return []
    if contour is True:
        return [0.5]
    if isinstance(contour, (str, bytes)) or not hasattr(contour, "__iter__") or getattr(contour, "ndim", 1) == 0:
        contour = [contour]
    return [real(c, "a contour level (of the map normalised to [0, 1])", low=0.0, high=1.0) for c in contour]


def overlay(
    image: Any,
    map: Any,  # noqa: A002 - public name
    *,
    alpha: float = 0.5,
    colormap: str | None = None,
    normalize: str = "minmax",
    interpolation: str = "bilinear",
    contour: ContourSpec = False,
    transparent_zero: Optional[bool] = None,
) -> np.ndarray:
    """Blend a coloured saliency map over an RGB image.

    The map is normalised to ``[0, 1]`` at its own resolution (:func:`normalize_map`),
    resized to the image (any aspect ratio; shrinking uses area averaging), coloured, and
    blended: ``out = (1 - a) * image + a * colour`` with ``a = alpha`` everywhere, or, with
    ``transparent_zero``, ``a = alpha * min(1, 2 |2 n - 1|)`` for the normalised value n: zero
    (the diverging map's centre) leaves the image as it is and evidence of either sign is
    drawn at full ``alpha`` from half the largest |value| on.

    Args:
        image: ``(H, W, 3)`` uint8 **RGB** image (not BGR: flip ``cv2.imread`` output
            with ``img[..., ::-1]``), or a PIL image of any mode (converted as ``explain`` converts it). To overlay on the region a model saw, pass
            ``crop_region(image, box)``; for the full image pass a map from ``paste_map``.
        map: 2-D map of any size: numpy array or torch tensor on any device (e.g.
            ``explanation.maps[i]``). NaN/inf is an error.
        alpha: Opacity of the colour layer, 0 (image only) to 1 (colour only).
        colormap: Colormap name, case-insensitive: any OpenCV one (``"jet"``,
            ``"viridis"``, ``"inferno"``, ``"turbo"``, ...) or the diverging ``"bwr"`` /
            ``"coolwarm"``; ``"_r"`` reverses. ``None``: ``"bwr"`` for
            ``normalize="signed"``, else ``"jet"``.
        normalize: ``"minmax"``, ``"percentile"``, ``"signed"`` or ``"none"``.
        interpolation: Map resizing: ``"nearest"`` (see the patches), ``"bilinear"`` or
            ``"bicubic"``.
        contour: ``True`` draws the iso-contour of the normalised map at 0.5 (white
            with a dark edge, visible on any colour); a number or a sequence of numbers
            gives other levels, each in ``[0, 1]``.
        transparent_zero: fade the colour out towards zero (see above); None means True
            for ``normalize="signed"`` and False otherwise.

    Returns:
        New ``(H, W, 3)`` uint8 RGB array; the input image is not modified.

    Raises:
        ValueError: Bad image, map, alpha, mode, colormap or interpolation name.
    """
    img = as_rgb(image)
    a = real(alpha, "alpha", low=0.0, high=1.0)  # (None was a TypeError, "0.5" was taken as 0.5)
    levels = _contour_levels(contour)
    if colormap is None:
        colormap = "bwr" if str(normalize).lower() == "signed" else "jet"
    colormap_lut(colormap)  # validate the name before any work
    h, w = img.shape[:2]
    norm = np.clip(_resize(normalize_map(map, normalize), (h, w), interpolation), 0.0, 1.0)
    colour = apply_colormap(norm, colormap)
    if transparent_zero is None:
        transparent_zero = str(normalize).lower() == "signed"
    if transparent_zero:
        weight = (a * np.minimum(1.0, 2.0 * np.abs(2.0 * norm - 1.0)))[..., None]
        blend = img.astype(np.float32) * (1.0 - weight) + colour.astype(np.float32) * weight
        out = np.clip(np.rint(blend), 0, 255).astype(np.uint8)
    elif a == 0.0:
        out = img.copy()
    elif a == 1.0:
        out = colour
    else:
        blend = img.astype(np.float32) * (1.0 - a) + colour.astype(np.float32) * a
        out = np.clip(np.rint(blend), 0, 255).astype(np.uint8)
    if levels:
        thickness = max(1, round(min(h, w) / 256))
        # Replicate-pad the mask so the traced outline of a region touching the image
        # edge runs outside the image: only true iso-lines are drawn, never the frame.
        m = thickness + 4
        for level in levels:
            mask = cv2.copyMakeBorder((norm >= level).astype(np.uint8), m, m, m, m, cv2.BORDER_REPLICATE)
            contours, _ = cv2.findContours(mask, cv2.RETR_LIST, cv2.CHAIN_APPROX_NONE)
            cv2.drawContours(out, contours, -1, (0, 0, 0), thickness + 2, cv2.LINE_8, offset=(-m, -m))
            cv2.drawContours(out, contours, -1, (255, 255, 255), thickness, cv2.LINE_8, offset=(-m, -m))
    return np.ascontiguousarray(out)


def readable(image: np.ndarray, min_side: int = MIN_SIDE) -> np.ndarray:
    """``image`` enlarged so that its shortest side is at least ``min_side``; unchanged when it
    already is.

    An image at most half that size is enlarged by a whole factor with nearest neighbour (the
    pixels the model saw, each a crisp block: 64 px becomes 256 px). A larger one (e.g. 224 px)
    is resized smoothly to exactly ``min_side`` on its shortest side: a whole factor would double
    it (four times the pixels to draw and write) for no gain in legibility.
    """
    if not isinstance(image, np.ndarray):  # a PIL image or a path (an AttributeError: no .shape)
        image = as_rgb(image)
    short = max(1, min(image.shape[:2]))
    if short >= min_side:
        return image
    if 2 * short <= min_side:
        factor = -(-int(min_side) // short)
        return cv2.resize(image, (image.shape[1] * factor, image.shape[0] * factor), interpolation=cv2.INTER_NEAREST)
    scale = min_side / short
    size = (max(min_side, round(image.shape[1] * scale)), max(min_side, round(image.shape[0] * scale)))
    return cv2.resize(image, size, interpolation=cv2.INTER_LINEAR)
