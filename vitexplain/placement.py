"""Where a map's cells lie on an image's pixels: maps resized onto the model input (cells of a padding patch
embedding on their own pixels), placed on the crop box of the original image the model saw a crop of, and the
image an explanation is drawn on (an array, a PIL image or a path). Used by :mod:`vitexplain.results`."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch.nn.functional as F
from torch import Tensor

from .layout import TokenLayout

__all__ = ["drawable", "crop_of", "pasted", "covered_pixels", "upsampled"]


def drawable(image: Any) -> np.ndarray:
    """The image to draw on as (H, W, 3) uint8 RGB: an array, a PIL image, or a path (read as ``explain`` reads it)."""
    from .data.arrays import as_rgb

    return as_rgb(image)


def crop_of(boxes: Optional[list[Any]], index: int, size: tuple[int, int]) -> Optional[Any]:
    """The crop box of image ``index`` when an image of ``size`` (H, W) is its original and the model saw only a
    crop of it (then a map must be placed on the box, :func:`pasted`); None otherwise."""
    box = boxes[index] if boxes else None
    if box is None or tuple(size) != tuple(box.image_size):
        return None
    return None if (box.left, box.top, box.right, box.bottom) == (0, 0, size[1], size[0]) else box


def pasted(maps: Tensor, box: Any, signed: bool) -> Tensor:
    """(..., H_in, W_in) maps at the model input's size placed on ``box`` of the original image: (..., H, W); the
    pixels the model did not see take the map's lowest value (zero for signed maps, drawn clear)."""
    import torch

    from .data.images import paste_map

    flat = maps.reshape(-1, *maps.shape[-2:])
    placed = [torch.from_numpy(paste_map(m, box, fill=0.0 if signed else None)) for m in flat]
    return torch.stack(placed).reshape(*maps.shape[:-2], *placed[0].shape)


def covered_pixels(layout: Optional[TokenLayout], grid: tuple[int, ...], input_size: tuple[int, int],
                   size: tuple[int, int]) -> Optional[tuple[int, int]]:
    """(H', W'): the pixels at the scale of ``size`` that a map's cells (its ``grid``) cover when they reach past
    the input's bottom or right edge (a patch embedding that pads the image, timm ``dynamic_img_pad``: a 50 x 70
    input in 16 px patches is a 4 x 5 grid over 64 x 80 pixels); None when the cells lie on the input."""
    if layout is None or tuple(grid) != tuple(layout.grid):
        return None
    reach = [g * p for g, p in zip(layout.grid, layout.patch_size)]
    if reach[0] <= input_size[0] and reach[1] <= input_size[1]:
        return None
    return tuple(max(s, round(s * r / i)) for s, r, i in zip(size, reach, input_size))  # type: ignore[return-value]


def upsampled(maps: Tensor, layout: Optional[TokenLayout], input_size: tuple[int, int], size: tuple[int, int],
              mode: str = "bilinear") -> Tensor:
    """(..., gh, gw) maps resized to ``size``: (..., H, W); cells that reach past the input (a padding patch
    embedding, :func:`covered_pixels`) are resized onto their own pixels and the padding cropped."""
    covered = covered_pixels(layout, tuple(maps.shape[-2:]), input_size, size)
    kwargs = {"align_corners": False} if mode in ("bilinear", "bicubic") else {}
    flat = F.interpolate(maps.reshape(-1, 1, *maps.shape[-2:]), size=covered or size, mode=mode, **kwargs)
    return flat[..., :size[0], :size[1]].reshape(*maps.shape[:-2], *size)
