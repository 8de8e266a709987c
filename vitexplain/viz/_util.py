"""Small shared helpers for viz: the array checks of :mod:`vitexplain.data.arrays`, and checks of the
numbers a drawing function takes (sizes, scales, opacities), so that a bad one is a
:class:`~vitexplain.errors.UsageError` saying what is wrong, not an OpenCV crash or an empty figure."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Optional

from ..data.arrays import as_rgb, check_rgb, map_to_numpy
from ..errors import UsageError

__all__ = ["map_to_numpy", "check_rgb", "as_rgb", "real", "whole", "pixel_size", "rgb_color", "image_index"]


def real(value: Any, what: str, *, low: float = -math.inf, high: float = math.inf, low_open: bool = False) -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``).

    Raises:
        UsageError: not a real number (a bool, a string, None, NaN, inf) or out of the range.
    """
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a NumPy or 0-d torch scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise UsageError(f"{what} must be a finite number, got {type(value).__name__} {value!r}")
    number = float(value)
    if number < low or number > high or (low_open and number == low):
        bracket = "(" if low_open else "["
        raise UsageError(f"{what} must be in {bracket}{low:g}, {high:g}], got {value!r}")
    return number


def whole(value: Any, what: str, *, low: int = 1, high: Optional[int] = None) -> int:
    """``value`` as an int in ``[low, high]``.

    Raises:
        UsageError: not an integer (a bool, a float, None) or out of the range.
    """
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise UsageError(f"{what} must be a whole number, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        span = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise UsageError(f"{what} must be {span}, got {value!r}")
    return int(value)


def pixel_size(value: Any, what: str) -> tuple[int, int]:
    """``(H, W)`` of a tile: an int (a square) or a pair of positive whole numbers of pixels.

    Raises:
        UsageError: anything else.
    """
    values = [value] if isinstance(value, Integral) and not isinstance(value, bool) else (
        list(value) if isinstance(value, (tuple, list)) else None)
    if values is None or len(values) not in (1, 2):
        raise UsageError(f"{what} must be (H, W) or an int, in positive whole pixels; got {value!r}")
    h, w = (whole(v, what) for v in (values[0], values[-1]))
    return h, w


def rgb_color(value: Any, what: str) -> tuple[int, int, int]:
    """``value`` as an (R, G, B) colour of three whole numbers in [0, 255].

    Raises:
        UsageError: anything else (a colour name, two or four numbers, a float).
    """
    values = list(value) if isinstance(value, (tuple, list)) or getattr(value, "ndim", None) == 1 else None
    if values is None or len(values) != 3:
        raise UsageError(f"{what} must be an (R, G, B) triple of whole numbers in [0, 255], got {value!r}")
    r, g, b = (whole(v, what, low=0, high=255) for v in values)
    return r, g, b


def image_index(index: Any, count: int, holder: str = "this explanation") -> int:
    """``index`` checked against a batch of ``count`` images (negative counts from the end); ``holder`` names
    what holds them in the message.

    Raises:
        UsageError: not an integer, or out of range.
    """
    if hasattr(index, "item") and getattr(index, "ndim", None) == 0:  # a NumPy or 0-d torch integer (argmax)
        index = index.item()
    if isinstance(index, bool) or not isinstance(index, Integral):
        raise UsageError(f"index must be an integer image index, got {type(index).__name__} {index!r}")
    index = int(index)
    if not -count <= index < count:
        raise UsageError(f"image index {index} is out of range: {holder} holds {count} image(s) (0..{count - 1})")
    return index % count
