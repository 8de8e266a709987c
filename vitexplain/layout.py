"""Token layout of Vision Transformers: prefix tokens and the patch grid for any input size.

A ViT sequence is ``[prefix tokens] + [patch tokens]``: the class token, a distillation token
(DeiT-distilled) and register tokens, then the patches in row-major order over a grid
(gh, gw) that depends on the actual input size (not always square, not always 14 x 14).
Swin-style models attend inside windows; their layout reports ``windowed=True`` and no grid.

This module is the geometry only. The layout of a given model comes from its adapter
(``vitexplain.adapters``, the one place that recognises a model family) through
:func:`vitexplain.token_layout` (:mod:`vitexplain.facade`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import UnsupportedModelError, UsageError

__all__ = ["TokenLayout", "WindowGeometry", "pair", "patch_multiple_advice"]


@dataclass(frozen=True)
class TokenLayout:
    """Where the patch tokens are in a ViT sequence.

    Attributes:
        num_prefix_tokens: tokens before the patches (class + distillation + registers).
        grid: (gh, gw) patch grid for the input size, or None for windowed attention.
        has_class_token: whether token 0 is a class token.
        readout: which query row(s) the classifier reads: ``"class"`` (the class token),
            ``"mean"`` (average pooling over the patch tokens), ``"all"`` (average pooling over every token,
            prefix tokens included: timm's ``pool_include_prefix=True``), ``"prefix"`` (the mean of every prefix
            token's row: a distilled DeiT averages its class and distillation heads) or ``"pool"`` (an
            attention-pooling head: a learned query attends over the final tokens, as SigLIP's MAP head;
            its attention row, recorded in the forward, is the readout).
        windowed: attention runs inside local windows (Swin); rollout does not apply.
        patch_size: (ph, pw) in pixels, when known.
    """

    num_prefix_tokens: int
    grid: Optional[tuple[int, int]]
    has_class_token: bool
    readout: Literal["class", "mean", "prefix", "pool", "all"] = "class"
    windowed: bool = False
    patch_size: Optional[tuple[int, int]] = None

    @property
    def class_index(self) -> Optional[int]:
        """Index of the class token, or None when there is none."""
        return 0 if self.has_class_token else None

    @property
    def num_patches(self) -> int:
        """gh * gw."""
        if self.grid is None:
            raise UnsupportedModelError(
                "this model uses windowed attention (Swin-style): there is no single patch "
                "grid over the whole sequence; use gradient-on-token methods instead"
            )
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        """Sequence length N = prefix tokens + patches."""
        return self.num_prefix_tokens + self.num_patches

    @property
    def patch_slice(self) -> slice:
        """Slice selecting the patch tokens of a sequence."""
        return slice(self.num_prefix_tokens, self.num_prefix_tokens + self.num_patches)

    def to_grid(self, tokens: Tensor) -> Tensor:
        """Reshape per-patch values to the grid.

        Args:
            tokens: (..., N) values over the whole sequence, or (..., gh * gw) over patches.

        Returns:
            (..., gh, gw).
        """
        if self.grid is None:
            raise UnsupportedModelError("windowed attention (Swin-style) has no single patch grid to reshape to")
        n = tokens.shape[-1]
        if n == self.num_tokens:
            tokens = tokens[..., self.patch_slice]
        elif n != self.num_patches:
            raise UsageError(
                f"expected {self.num_tokens} tokens ({self.num_prefix_tokens} prefix + "
                f"{self.grid[0]}x{self.grid[1]} patches) or {self.num_patches} patches, got {n}"
            )
        return tokens.reshape(*tokens.shape[:-1], *self.grid)

    def for_map(self, grid: tuple[int, int], input_size: tuple[int, int]) -> "TokenLayout":
        """This layout as it describes a map on ``grid`` of an input of ``input_size`` pixels.

        A map on another grid than this layout's (a stage grid of a hierarchical model) gets
        that grid; ``patch_size`` becomes the pixels one map cell covers when it is unknown or
        does not fit the grid (hybrid stems whose patch embedding reads a feature map)."""
        grid = (int(grid[0]), int(grid[1]))
        patch = self.patch_size
        fits = patch is not None and all(abs(p * g - s) < p for p, g, s in zip(patch, grid, input_size))
        if grid == self.grid and fits:
            return self
        stride = patch if fits else (max(1, round(input_size[0] / grid[0])), max(1, round(input_size[1] / grid[1])))
        if grid == self.grid:
            return replace(self, patch_size=stride)
        return replace(self, num_prefix_tokens=0, grid=grid, has_class_token=False, patch_size=stride)

    def pixel_cells(self, input_size: tuple[int, int], device: Optional[torch.device] = None) -> Tensor:
        """(H, W) long: the grid cell (row-major) each pixel of an ``input_size`` input belongs to.

        Cell (i, j) covers rows ``[i ph, (i + 1) ph)`` and columns ``[j pw, (j + 1) pw)``: a padded
        input's last cells (timm ``dynamic_img_pad`` pads at the bottom and right) cover fewer pixels,
        and pixels past the last cell (a model that drops them) go to it. Without a ``patch_size``
        that fits the grid (``gh ph`` within one patch of ``H``, as :meth:`for_map` asks), the grid
        is split evenly over the pixels.
        """
        if self.grid is None:
            raise UnsupportedModelError("windowed attention (Swin-style) has no single patch grid to put pixels on")
        (h, w), (gh, gw) = input_size, self.grid
        rows, cols = torch.arange(h, device=device), torch.arange(w, device=device)
        patch = self.patch_size
        if patch is not None and all(abs(p * g - n) < p for p, g, n in zip(patch, self.grid, (h, w))):
            rows, cols = (rows // patch[0]).clamp(max=gh - 1), (cols // patch[1]).clamp(max=gw - 1)
        else:
            rows, cols = torch.div(rows * gh, h, rounding_mode="floor"), torch.div(cols * gw, w, rounding_mode="floor")
        return rows[:, None] * gw + cols[None, :]

    def sum_cells(self, pixels: Tensor) -> Tensor:
        """(..., H, W) per-pixel values summed over each cell's own pixels (:meth:`pixel_cells`):
        (..., gh, gw)."""
        lead, (h, w) = pixels.shape[:-2], pixels.shape[-2:]
        flat = pixels.reshape(-1, h * w)
        cells = self.pixel_cells((h, w), pixels.device).flatten().expand_as(flat)
        summed = flat.new_zeros(flat.shape[0], self.num_patches).scatter_add_(1, cells, flat)
        return summed.view(*lead, *self.grid)  # type: ignore[misc]  (pixel_cells checked the grid)

    def check(self, num_tokens: int) -> None:
        """Raise a clear error if a recorded sequence length does not fit this layout."""
        if num_tokens != self.num_tokens:
            raise UnsupportedModelError(
                f"attention over {num_tokens} tokens does not match the token layout "
                f"({self.num_prefix_tokens} prefix tokens + grid {self.grid} = "
                f"{self.num_tokens}); the model may pool or merge tokens between blocks"
            )


def pair(value: object) -> tuple[int, int]:
    """``(h, w)`` from an int (square) or a 2-sequence (a size, patch, stride or kernel): ``(int, int)``."""
    if isinstance(value, (tuple, list)):
        return int(value[0]), int(value[1])
    return int(value), int(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class WindowGeometry:
    """How one block lays its stage's tokens out in windows.

    Attributes:
        grid: (H, W) real tokens of the stage.
        window: (wh, ww) window size.
        shift: (sh, sw) cyclic shift (the model rolls by minus this).
        pad_first: True when the grid is padded to window multiples before the roll
            (torchvision, Hugging Face), False when the real grid is rolled, then padded (timm).
    """

    grid: tuple[int, int]
    window: tuple[int, int]
    shift: tuple[int, int]
    pad_first: bool

    @property
    def padded(self) -> tuple[int, int]:
        """(Hp, Wp): the grid padded to multiples of the window."""
        return tuple(math.ceil(g / w) * w for g, w in zip(self.grid, self.window))  # type: ignore[return-value]

    @property
    def num_windows(self) -> int:
        hp, wp = self.padded
        return (hp // self.window[0]) * (wp // self.window[1])

    @property
    def window_area(self) -> int:
        return self.window[0] * self.window[1]

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    def index(self, device: Optional[torch.device] = None) -> Tensor:
        """Where each window slot comes from: (nW, wh * ww) long.

        Entry [w, a] is the row-major index into the (H, W) grid of the token in slot a of
        window w (windows in the order of the model's (B * nW) batch), or -1 for padding.
        """
        h, w = self.grid
        hp, wp = self.padded
        idx = torch.arange(h * w, device=device).view(h, w)
        shifts, dims = (-self.shift[0], -self.shift[1]), (0, 1)
        if self.pad_first:
            idx = F.pad(idx, (0, wp - w, 0, hp - h), value=-1).roll(shifts, dims)
        else:
            idx = F.pad(idx.roll(shifts, dims), (0, wp - w, 0, hp - h), value=-1)
        wh, ww = self.window
        return idx.view(hp // wh, wh, wp // ww, ww).permute(0, 2, 1, 3).reshape(-1, wh * ww)

    def partition(self, tokens: Tensor) -> Tensor:
        """Grid tokens into the model's windows: (B, H, W, C) -> (B * nW, wh * ww, C), zeros at padding."""
        b, h, w, c = tokens.shape
        flat = torch.cat([tokens.reshape(b, h * w, c), tokens.new_zeros(b, 1, c)], dim=1)
        idx = self.index(tokens.device).flatten()
        idx = torch.where(idx < 0, h * w, idx)
        return flat[:, idx].reshape(b * self.num_windows, self.window_area, c)

    def unpartition(self, windows: Tensor) -> Tensor:
        """Windows back onto the grid (padding dropped): (B * nW, wh * ww, C) -> (B, H, W, C)."""
        c = windows.shape[-1]
        flat = windows.reshape(-1, self.num_windows * self.window_area, c)
        idx = self.index(windows.device).flatten()
        real = idx >= 0
        out = windows.new_zeros(flat.shape[0], self.num_tokens, c)
        out[:, idx[real]] = flat[:, real]
        return out.view(flat.shape[0], *self.grid, c)


def patch_multiple_advice(patch: tuple[int, int], size: tuple[int, int]) -> str:
    """What to do with an (H, W) input that the (ph, pw) patch size does not divide: the nearest smaller multiple."""
    return (f"its patch size {patch[0]}x{patch[1]} must divide the input: resize or crop it to a multiple, e.g. "
            f"{max(patch[0], size[0] // patch[0] * patch[0])}x{max(patch[1], size[1] // patch[1] * patch[1])}")
