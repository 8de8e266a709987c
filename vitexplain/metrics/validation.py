"""Input checks shared by the metrics: maps, masks, sizes, with messages that name the expected shape.

Every metric accepts torch tensors or NumPy arrays (converted with :func:`torch.as_tensor`) and
raises a :class:`~vitexplain.errors.UsageError` (a ``ValueError``) or
:class:`~vitexplain.errors.InputError` that says what was expected; a NaN or infinite value in a
map is an error, never a silent NaN score.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..errors import InputError, UsageError

__all__ = [
    "ArrayLike", "Size2", "as_tensor", "check_finite", "check_maps", "check_masks", "check_images",
    "check_positive_int", "check_seed", "size2", "exact_dtype", "whole", "real",
]

ArrayLike = Any  # torch.Tensor, numpy.ndarray or a nested sequence of numbers
Size2 = Union[int, Tuple[int, int], Sequence[int]]


def as_tensor(x: ArrayLike, name: str) -> Tensor:
    """``x`` as a tensor (tensors pass through unchanged); an InputError names ``name`` otherwise."""
    if isinstance(x, Tensor):
        return x
    if hasattr(x, "maps") and hasattr(x, "upsample"):  # an Explanation: which of its tensors is the user's choice
        raise InputError(f"{name} must be a tensor, got an {type(x).__name__}: pass e.upsample((H, W)), its maps on the "
                         "pixels of an (H, W) image as its cells cover them, or e.maps")
    try:
        return torch.as_tensor(x)
    except Exception as exc:  # noqa: BLE001 - re-raised with a clear message
        raise InputError(f"{name} must be a torch.Tensor or a NumPy array, got {type(x).__name__}") from exc


def check_finite(x: Tensor, name: str) -> None:
    """Raise a UsageError naming the batch items of ``x`` (B, ...) that hold NaN or inf."""
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).flatten(1).any(1).nonzero().flatten().tolist()
        raise UsageError(
            f"{name} contains NaN or infinite values (batch items {bad[:10]}"
            f"{' ...' if len(bad) > 10 else ''}); fix the explanation method or drop those items"
        )


def _batch_of_2d(x: Tensor, name: str, dims: str, what: str, batch: Optional[int], match: str) -> Tensor:
    """Check that ``x`` is (B, *dims*), with B == ``batch`` when given."""
    if x.ndim != 3:
        raise UsageError(f"{name} must have shape (B, {dims}) ({what}), got shape {tuple(x.shape)}")
    if batch is not None and x.shape[0] != batch:
        raise UsageError(f"{name} must have shape ({batch}, {dims}) to match {match}, got {tuple(x.shape)}")
    return x


def check_maps(maps: ArrayLike, name: str = "maps", batch: Optional[int] = None) -> Tensor:
    """Validate a batch of maps.

    Args:
        maps: ``(B, h, w)`` real-valued maps.
        name: what to call them in error messages.
        batch: the expected B, if known.

    Returns:
        The maps, detached, as float32 (float64 stays float64), finite.
    """
    maps = _batch_of_2d(as_tensor(maps, name), name, "h, w", "one 2-D map per image; for a single map use map[None]",
                        batch, "the batch")
    if maps.shape[1] == 0 or maps.shape[2] == 0:
        raise UsageError(f"{name} has an empty spatial size {tuple(maps.shape[1:])}")
    if maps.is_complex():
        raise UsageError(f"{name} must be real-valued, got dtype {maps.dtype}")
    if maps.dtype != torch.float64:
        maps = maps.float()
    check_finite(maps, name)
    return maps.detach()


def check_masks(masks: ArrayLike, name: str = "masks", batch: Optional[int] = None) -> Tensor:
    """Validate a batch of masks: ``(B, H, W)``, bool or numbers (nonzero = inside); returns bool."""
    masks = _batch_of_2d(
        as_tensor(masks, name), name, "H, W",
        "one boolean mask per image at image resolution; for several objects pass their union, masks.any(dim=1)",
        batch, "maps",
    )
    if masks.dtype != torch.bool:
        check_finite(masks.float() if not masks.is_floating_point() else masks, name)
        masks = masks != 0
    return masks


def check_images(images: ArrayLike, name: str = "images") -> Tensor:
    """Validate a batch of preprocessed images: ``(B, C, H, W)`` floating point, finite."""
    images = as_tensor(images, name)
    if images.ndim != 4:
        raise UsageError(f"{name} must have shape (B, C, H, W), got {tuple(images.shape)}")
    if not images.is_floating_point():
        raise UsageError(f"{name} must be the preprocessed float tensor the model takes, got {images.dtype}")
    if images.shape[0] == 0:
        raise UsageError(f"{name} holds no images (batch size 0); pass at least one")
    check_finite(images, name)
    return images


def _scalar(value: Any) -> Any:
    """A NumPy scalar or a 0-d array / tensor as its Python number; anything else as it is."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def whole(value: Any, name: str) -> int:
    """``value`` as an int: Python, NumPy and 0-d tensor integers (``mask.sum()``, ``np.int64(3)``) are
    whole numbers; bools, floats (``2.0``) and anything else are a UsageError naming ``name``."""
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise UsageError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def real(value: Any, name: str) -> float:
    """``value`` as a finite float (Python, NumPy or 0-d tensor numbers); a UsageError naming ``name`` for
    bools, strings, None, NaN and inf."""
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise UsageError(f"{name} must be a finite number, got {type(value).__name__} {value!r}")
    return float(value)


def check_seed(seed: Any) -> int:
    """``seed`` as an int (NumPy integers too); a UsageError otherwise (None, floats and bools are not seeds)."""
    try:
        return whole(seed, "seed")
    except UsageError:
        raise UsageError(f"seed must be an int, got {seed!r}") from None


def check_positive_int(value: Any, name: str) -> int:
    """``value`` as an int >= 1 (NumPy integers too); a UsageError names ``name`` otherwise (bools are not
    ints here)."""
    try:
        number = whole(value, name)
    except UsageError:
        number = 0
    if number < 1:
        raise UsageError(f"{name} must be a positive int, got {value!r}")
    return number


def size2(size: Size2, name: str) -> Tuple[int, int]:
    """An int or a pair of ints (NumPy integers too) as a positive ``(H, W)``.

    Raises:
        UsageError: not one or two whole numbers (a float such as ``2.5`` was a TypeError, ``(5.5, 6)`` was
            truncated to ``(5, 6)``), or not positive.
    """
    if getattr(size, "ndim", None) == 0 or isinstance(size, (Integral, Real)):
        items = [size, size]
    elif isinstance(size, (str, bytes)) or not hasattr(size, "__iter__"):
        items = []
    else:
        items = list(size)
    if len(items) != 2:
        raise UsageError(f"{name} must be an int or a pair (H, W) of ints, got {size!r}")
    try:
        out = tuple(whole(s, name) for s in items)
    except UsageError:
        raise UsageError(f"{name} must be an int or a pair (H, W) of ints (whole pixels), got {size!r}") from None
    if out[0] <= 0 or out[1] <= 0:
        raise UsageError(f"{name} must be positive, got {size!r}")
    return out  # type: ignore[return-value]


def exact_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (everything but Apple's MPS), for ranks, correlations, peaks."""
    return torch.float32 if device.type == "mps" else torch.float64
