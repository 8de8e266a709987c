"""Array checks shared by data I/O and visualisation: maps to float32 numpy, RGB images.

Public here (``vitexplain.data.arrays``) so that both :mod:`vitexplain.data` and
:mod:`vitexplain.viz` use them without importing another package's private helpers.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import UsageError

__all__ = ["map_to_numpy", "check_rgb", "as_rgb"]


def map_to_numpy(map: Any, dtype: Any = np.float32) -> np.ndarray:  # noqa: A002 - the public argument is called map
    """Convert a 2-D map (numpy, torch tensor on any device/dtype, nested lists) to float32.

    Leading singleton dimensions are squeezed, so ``(1, gh, gw)`` is accepted.

    Args:
        map: The map.
        dtype: ``np.float32`` (default) or ``np.float64`` (keeps a float64 map's values: cast to float32,
            values below 1e-38 became 0 and above 3e38 inf).

    Returns:
        C-contiguous ``(h, w)`` array of ``dtype``.

    Raises:
        ValueError: The map is not 2-D, is empty, or contains NaN/inf.
    """
    if "complex" in str(getattr(map, "dtype", "")):  # a cast would drop the imaginary part, with a warning only
        raise UsageError(f"a map must hold real numbers, got {map.dtype}; pass its magnitude (abs) or real part")
    if hasattr(map, "detach") and hasattr(map, "cpu"):  # torch.Tensor, without importing torch
        map = map.detach().cpu()
        map = (map.double() if np.dtype(dtype) == np.float64 and str(map.dtype) == "torch.float64" else map.float()).numpy()
    try:
        m = np.asarray(map, dtype=dtype)
    except (TypeError, ValueError) as e:  # text, objects: not numbers
        raise UsageError(f"a map must hold numbers, got {type(map).__name__} ({e})") from None
    while m.ndim > 2 and m.shape[0] == 1:
        m = m[0]
    if m.ndim != 2 or m.size == 0:
        raise UsageError(f"expected a non-empty 2-D map (h, w), got shape {m.shape}")
    bad = ~np.isfinite(m)
    if bad.any():
        raise UsageError(
            f"map contains {int(bad.sum())} NaN/inf value(s) out of {m.size}; the method that "
            "produced it failed numerically (check the model output / gradients), or clean it "
            "with torch.nan_to_num first"
        )
    return np.ascontiguousarray(m)


def as_rgb(image: Any, what: str = "image") -> np.ndarray:
    """A path, a PIL image or an array, as ``(H, W, 3)`` uint8 (a path is read by
    :func:`~vitexplain.data.decoding.load_image`, an array checked by :func:`check_rgb`).

    A PIL image is converted as :func:`~vitexplain.data.decoding.load_image` converts a file (alpha
    composited on white, 16-bit gray keeping its high byte, 8-bit values in a 16-bit image as they are,
    ...): an opened image and its path give the same pixels (Pillow's own ``convert("RGB")`` drops alpha and
    saturates 16-bit images to white).
    """
    if isinstance(image, (str, os.PathLike)):  # a file, read as explain() reads it
        from .decoding import load_image

        return load_image(image)
    if hasattr(image, "convert") and hasattr(image, "size"):  # a PIL image, without importing PIL up front
        from .decoding import to_rgb

        return check_rgb(to_rgb(image), what)
    return check_rgb(image, what)


def check_rgb(image: Any, what: str = "image") -> np.ndarray:
    """Return ``image`` as an ``(H, W, 3)`` uint8 array or raise a helpful error."""
    is_tensor = hasattr(image, "detach") and hasattr(image, "cpu")  # torch, without importing it
    try:
        arr = np.asarray(image.detach().cpu()) if is_tensor else np.asarray(image)
    except ValueError as err:  # a nested list whose rows differ in length (NumPy: 'inhomogeneous shape')
        raise UsageError(f"{what} must be an (H, W, 3) uint8 RGB array, got a {type(image).__name__} of rows of "
                         "different lengths (images of different sizes in one list? pass each image as its own "
                         "array)") from err
    if arr.dtype == object or arr.ndim == 0:  # None, a number, a dict, a generator: not an image at all
        raise UsageError(f"{what} must be an (H, W, 3) uint8 RGB array (or a path or PIL image where images are "
                         f"read), got {type(image).__name__}")
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        hint = ""
        if is_tensor and arr.dtype.kind == "f":  # a preprocessed tensor (or a list of them): not an image to read
            hint = (" (a float tensor is not an image: images are uint8 (H, W, 3) arrays (vx.load_image, an "
                    "explanation's e.images), PIL images or paths; a preprocessed batch goes to explain() as one "
                    "(B, 3, H, W) tensor, e.g. torch.stack(tensors))")
        elif arr.dtype.kind == "f":  # (x * 255 was advised for any float image: one in [0, 255] became all white)
            finite = arr[np.isfinite(arr)] if arr.size else arr
            scale = "" if finite.size and float(finite.max()) > 1.0 else " * 255"
            hint = f" (float image? convert with np.clip(x{scale}, 0, 255).round().astype(np.uint8))"
        elif arr.ndim == 2:
            hint = " (grayscale? use np.repeat(x[..., None], 3, axis=2))"
        elif arr.ndim == 3 and arr.shape[0] == 3:
            hint = " (channels first? use x.transpose(1, 2, 0))"
        elif arr.ndim == 3 and arr.shape[2] == 4:
            hint = (" (RGBA? pass PIL.Image.fromarray(x), whose alpha is composited on white as an image file's is, "
                    "or drop it: x[..., :3])")
        elif arr.ndim == 3 and arr.shape[2] == 1:
            hint = " (grayscale? use np.repeat(x, 3, axis=2))"
        raise UsageError(
            f"{what} must be an (H, W, 3) uint8 RGB array, got shape {arr.shape} dtype {arr.dtype}{hint}"
        )
    if not arr.size:
        raise UsageError(f"{what} is empty ({arr.shape[0]}x{arr.shape[1]} pixels); leave it out of the input")
    return arr

