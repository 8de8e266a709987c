"""Small shared helpers for viz: the array checks of :mod:`vitexplain.data.arrays`."""

from __future__ import annotations

from ..data.arrays import check_rgb, map_to_numpy

__all__ = ["map_to_numpy", "check_rgb"]
