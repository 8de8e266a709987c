"""Whether a tensor's values are all finite, in one cheap pass (the input checks, and the capture's test of a
float attention mask)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["all_finite"]


def all_finite(x: Tensor) -> bool:
    """Whether every value of ``x`` is finite, by one sum and one read-back: a sum is finite only when every value
    is (a NaN or inf makes it NaN or inf); only a sum that overflowed (large finite values, e.g. a mask of
    ``finfo.min``) takes the elementwise check. ``torch.isfinite(x).all()`` makes four passes over ``x``
    (measured on SAM ViT-B's relative-position bias at 256 px: about 100 ms of an 1.8 s rollout)."""
    x = x.detach()
    if math.isfinite(x.sum().item()):
        return True
    return bool(torch.isfinite(x).all())
