"""Colormaps as 256-entry RGB lookup tables: every OpenCV colormap plus diverging ones.

Names are case-insensitive. OpenCV's maps (``cv2.COLORMAP_*``: ``"jet"``, ``"viridis"``,
``"inferno"``, ``"turbo"``, ...) are sampled once with ``cv2.applyColorMap`` and converted
from OpenCV's BGR to RGB, so every table here is **RGB**. OpenCV has no classic diverging
map, so two are built here for signed maps (value 0.5 = zero is the neutral centre):

- ``"bwr"``: linear blue (0, 0, 255) -> white (255, 255, 255) -> red (255, 0, 0), as
  matplotlib's ``bwr``. The default for ``normalize="signed"``.
- ``"coolwarm"``: Kenneth Moreland's smooth cool-warm map ("Diverging Color Maps for
  Scientific Visualization", 2009), interpolated in his Msh colour space from
  (59, 76, 192) through a light gray (221, 221, 221) to (180, 4, 38).

``"gray"`` is a plain ramp. Append ``"_r"`` to any name to reverse it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import cv2
import numpy as np
from ..errors import UsageError

__all__ = ["colormap_names", "colormap_lut", "apply_colormap", "DIVERGING"]

#: Names of the diverging maps (neutral colour at 0.5).
DIVERGING: tuple[str, ...] = ("bwr", "coolwarm")


@functools.lru_cache(maxsize=None)
def _opencv_maps() -> dict[str, int]:
    """OpenCV's colormaps by lower-case name (cached: read, never changed)."""
    return {
        n[len("COLORMAP_"):].lower(): int(getattr(cv2, n))
        for n in dir(cv2)
        if n.startswith("COLORMAP_")
    }


def colormap_names() -> list[str]:
    """All colormap names (without the ``"_r"`` reversed variants), sorted."""
    return sorted({*_opencv_maps(), *DIVERGING, "gray"})


def _bwr() -> np.ndarray:
    t = np.arange(256) / 255.0
    lo = np.clip(2 * t, 0, 1)  # blue -> white
    hi = np.clip(2 - 2 * t, 0, 1)  # white -> red
    rgb = np.stack([np.where(t < 0.5, lo, 1.0), np.minimum(lo, hi), np.where(t < 0.5, 1.0, hi)], -1)
    return rgb


# --- Moreland's Msh interpolation (sRGB <-> linear <-> XYZ(D65) <-> Lab <-> Msh) ---

_RGB2XYZ = np.array(
    [[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]
)
_WHITE = np.array([0.95047, 1.0, 1.08883])


def _rgb_to_msh(rgb: np.ndarray) -> np.ndarray:
    lin = np.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    xyz = _RGB2XYZ @ lin / _WHITE
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    lab = np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])
    m = float(np.linalg.norm(lab))
    return np.array([m, math.acos(lab[0] / m), math.atan2(lab[2], lab[1])])


def _msh_to_rgb(msh: np.ndarray) -> np.ndarray:
    m, s, h = msh
    lab = np.array([m * math.cos(s), m * math.sin(s) * math.cos(h), m * math.sin(s) * math.sin(h)])
    fy = (lab[0] + 16) / 116
    f = np.array([fy + lab[1] / 500, fy, fy - lab[2] / 200])
    xyz = np.where(f > 0.20689, f**3, (f - 16 / 116) / 7.787) * _WHITE
    lin = np.linalg.solve(_RGB2XYZ, xyz)
    rgb = np.where(lin > 0.0031308, 1.055 * np.abs(lin) ** (1 / 2.4) - 0.055, 12.92 * lin)
    return np.clip(rgb, 0.0, 1.0)


def _adjust_hue(msh: np.ndarray, m_unsat: float) -> float:
    m, s, h = msh
    if m >= m_unsat:
        return float(h)
    spin = s * math.sqrt(m_unsat**2 - m**2) / (m * math.sin(s))
    return float(h + spin) if h > -math.pi / 3 else float(h - spin)


def _moreland(rgb1: tuple[float, float, float], rgb2: tuple[float, float, float]) -> np.ndarray:
    a0, b0 = _rgb_to_msh(np.array(rgb1)), _rgb_to_msh(np.array(rgb2))
    out = np.empty((256, 3))
    for i in range(256):
        t, a, b = i / 255.0, a0.copy(), b0.copy()
        dh = abs(a[2] - b[2]) % (2 * math.pi)
        if a[1] > 0.05 and b[1] > 0.05 and min(dh, 2 * math.pi - dh) > math.pi / 3:
            mid = np.array([max(a[0], b[0], 88.0), 0.0, 0.0])
            if t < 0.5:
                b, t = mid, 2 * t
            else:
                a, t = mid, 2 * t - 1
        if a[1] < 0.05 < b[1]:
            a[2] = _adjust_hue(b, a[0])
        elif b[1] < 0.05 < a[1]:
            b[2] = _adjust_hue(a, b[0])
        out[i] = _msh_to_rgb((1 - t) * a + t * b)
    return out


def colormap_lut(name: str) -> np.ndarray:
    """The ``(256, 3)`` uint8 RGB lookup table of a colormap.

    Args:
        name: Case-insensitive colormap name (see :func:`colormap_names`), optionally
            with a ``"_r"`` suffix for the reversed map.

    Returns:
        Read-only ``(256, 3)`` uint8 array; row ``i`` is the colour of value ``i / 255``.

    Raises:
        UsageError: not a name, or an unknown one; the message lists the choices.
    """
    if not isinstance(name, str):  # (a list is not hashable: the cache below raised a bare TypeError)
        raise UsageError(f"colormap must be a name (a string), got {type(name).__name__} {name!r}; choose from "
                         f"{', '.join(colormap_names())}")
    key = name.strip().lower()
    if (key[:-2] if key.endswith("_r") else key) not in {*colormap_names(), "grey"}:  # ("grey": gray's alias)
        raise UsageError(
            f"unknown colormap {name!r}; choose from {', '.join(colormap_names())} "
            "(case-insensitive; add '_r' to reverse)"
        )
    return _lut(key)


@functools.lru_cache(maxsize=None)
def _lut(key: str) -> np.ndarray:
    """:func:`colormap_lut` of a lower-case, stripped name (cached: tables are read-only)."""
    reverse = key.endswith("_r")
    base = key[:-2] if reverse else key
    cv_maps = _opencv_maps()
    if base in cv_maps:
        ramp = np.arange(256, dtype=np.uint8).reshape(256, 1)
        lut = cv2.applyColorMap(ramp, cv_maps[base]).reshape(256, 3)[:, ::-1]  # BGR -> RGB
    elif base == "bwr":
        lut = np.rint(_bwr() * 255)
    elif base == "coolwarm":
        lut = np.rint(_moreland((0.230, 0.299, 0.754), (0.706, 0.016, 0.150)) * 255)
    else:  # gray / grey (colormap_lut checked the name)
        lut = np.repeat(np.arange(256).reshape(256, 1), 3, axis=1)
    lut = np.ascontiguousarray(np.asarray(lut, dtype=np.uint8)[::-1] if reverse else lut, dtype=np.uint8)
    lut.setflags(write=False)
    return lut


def apply_colormap(values: Any, colormap: str = "jet") -> np.ndarray:
    """Colour values in ``[0, 1]`` with a colormap.

    Args:
        values: ``(H, W)`` array (or tensor) of values in ``[0, 1]``; values outside are
            clipped, NaN is an error.
        colormap: Colormap name (case-insensitive; see :func:`colormap_names`).

    Returns:
        ``(H, W, 3)`` uint8 **RGB** array.
    """
    if hasattr(values, "detach") and hasattr(values, "cpu"):
        values = values.detach().cpu().float().numpy()
    v = np.asarray(values, dtype=np.float32)
    if np.isnan(v).any():
        raise UsageError("apply_colormap got NaN values")
    idx = np.rint(np.clip(v, 0.0, 1.0) * 255.0).astype(np.uint8)
    return colormap_lut(colormap)[idx]
