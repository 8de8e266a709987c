"""Where each image token of a vision-language model reads its pixels, and token scores as maps at the original resolution.

An :class:`ImageView` is one image's token geometry: one or more :class:`Piece` grids, each covering a box of the
original image (the processed image, or tiles and a thumbnail). :func:`render` turns per-token scores into maps at the
original resolution: every original pixel takes the score of the token whose grid cell covers its centre (the token's
footprint), summed over the pieces that cover it (tiles and a thumbnail both cover a pixel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from ...errors import UnsupportedModelError

__all__ = ["Piece", "ImageView", "render", "processed_box"]


@dataclass(frozen=True)
class Piece:
    """One grid of image tokens over a box of the original image.

    Attributes:
        name: ``"image"``, ``"thumbnail"``, ``"tile r,c"``.
        grid: (gh, gw) tokens, in row-major order in the sequence.
        box: (y0, x0, y1, x1) the region of the original image the grid covers, in original pixels
            (may reach outside the image where the processor padded it).
        start: index of the grid's first token among the image's pixel-bearing tokens.
        clamp: pixels outside the box take the nearest edge cell instead of nothing (the edge tokens'
            receptive fields reach past the box: Florence-2's overlapping convolutions).
        extent: (y0, x0, y1, x1) the part of the original image the piece holds, where the grid's box reaches
            past it into padding that overlaps other pieces (Idefics2 pads each quadrant to the batch's largest
            piece: an edge cell partly over padding holds only the pixels inside the quadrant); None: the box.
    """

    name: str
    grid: tuple[int, int]
    box: tuple[float, float, float, float]
    start: int
    clamp: bool = False
    extent: Optional[tuple[float, float, float, float]] = None

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]


@dataclass(frozen=True)
class ImageView:
    """Where one image's tokens are: its original size and its token grids.

    Attributes:
        size: (H, W) of the original image.
        pieces: the token grids, in sequence order.
        skip: indices, among the image's image-token positions, of tokens without pixels.
        sequence_tokens: how many image tokens the sequence holds when they are not the pixel-bearing
            tokens themselves (a Q-Former's queries, mapped to the patches by
            :meth:`VLMAdapter.to_pixel_tokens`); None: ``num_tokens + len(skip)``.
    """

    size: tuple[int, int]
    pieces: tuple[Piece, ...]
    skip: tuple[int, ...] = ()
    sequence_tokens: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        """How many pixel-bearing tokens the image has."""
        return max(p.start + p.num_tokens for p in self.pieces)

    def pixel_columns(self, columns: Tensor) -> Tensor:
        """The image's pixel-bearing token positions among all its image-token positions ``columns``
        (``skip``: indices of tokens without pixels, e.g. LLaVA-NeXT's row newlines).

        Raises:
            UnsupportedModelError: the sequence holds another number of image tokens than the geometry.
        """
        expected = self.sequence_tokens if self.sequence_tokens is not None else self.num_tokens + len(self.skip)
        if columns.numel() != expected:
            raise UnsupportedModelError(
                f"the sequence holds {columns.numel()} image tokens, but the processed geometry of a {self.size[0]}x"
                f"{self.size[1]} image has {expected}; the processor and the model disagree "
                "(pass the model's own processor)"
            )
        if not self.skip:
            return columns
        keep = torch.ones(columns.numel(), dtype=torch.bool, device=columns.device)
        keep[list(self.skip)] = False
        return columns[keep]


def _cells(length: int, low: float, high: float, cells: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """For each of ``length`` pixels (centres at i + 0.5), its grid cell over [low, high) and whether it is inside."""
    centres = torch.arange(length, device=device, dtype=torch.float64) + 0.5
    index = torch.floor((centres - low) / (high - low) * cells).long()
    inside = (index >= 0) & (index < cells)
    return index.clamp(0, cells - 1), inside


def render(scores: Tensor, view: ImageView) -> tuple[Tensor, list[Tensor]]:
    """Token scores as maps at the original resolution.

    Args:
        scores: (T, n) scores of the image's pixel-bearing tokens.
        view: the image's token geometry (n == ``view.num_tokens``, the pixel-bearing tokens).

    Returns:
        ((T, H, W) the sum of the pieces' maps, per piece its (T, H, W) map, zero outside its box).
    """
    if scores.shape[-1] != view.num_tokens:
        raise UnsupportedModelError(
            f"the image has {scores.shape[-1]} image tokens in the sequence, but its processed geometry has "
            f"{view.num_tokens}; the processor and the model disagree (pass the model's own processor)"
        )
    height, width = view.size
    layers = []
    for piece in view.pieces:
        gh, gw = piece.grid
        if not piece.num_tokens:  # no tokens: LLaVA-NeXT's unpadding leaves no row of a very wide image's tiles
            layers.append(scores.new_zeros(scores.shape[0], height, width))
            continue
        grid = scores[:, piece.start : piece.start + piece.num_tokens].reshape(-1, gh, gw)
        y0, x0, y1, x1 = piece.box
        rows, row_in = _cells(height, y0, y1, gh, scores.device)
        cols, col_in = _cells(width, x0, x1, gw, scores.device)
        layer = grid[:, rows][:, :, cols]
        if not piece.clamp:
            layer = layer * (row_in[:, None] & col_in[None, :]).to(scores.dtype)
        if piece.extent is not None:  # pixels past the piece's own part of the image: padding there, not these pixels
            centres_y = torch.arange(height, device=scores.device, dtype=torch.float64) + 0.5
            centres_x = torch.arange(width, device=scores.device, dtype=torch.float64) + 0.5
            ey0, ex0, ey1, ex1 = piece.extent
            keep = ((centres_y >= ey0) & (centres_y < ey1))[:, None] & ((centres_x >= ex0) & (centres_x < ex1))[None, :]
            layer = layer * keep.to(scores.dtype)
        layers.append(layer)
    return torch.stack(layers).sum(dim=0), layers


def processed_box(image_processor: Any, height: int, width: int) -> tuple[float, float, float, float]:
    """The box of an (H, W) original image that a resize (+ centre crop) image processor keeps.

    Follows transformers' processors: ``size={"shortest_edge": S}`` scales the short side to S and
    the long side to ``int(S * long / short)``; ``size={"height", "width"}`` resizes to that size;
    then ``crop_size`` (when ``do_center_crop``) cuts the centre, padding first where the crop is larger.
    An image processor that pads the image to a square first (LLaVA's ``LlavaImageProcessor`` with ``do_pad``:
    centred, ``pad_to_square``) resizes and crops that square: the box reaches into the padding.
    """
    if getattr(image_processor, "do_pad", False) and callable(getattr(image_processor, "pad_to_square", None)):
        side = max(height, width)
        top, left = (side - height) // 2, (side - width) // 2  # (transformers' pad_to_square offsets)
        y0, x0, y1, x1 = _resized_box(image_processor, side, side)
        return (y0 - top, x0 - left, y1 - top, x1 - left)
    return _resized_box(image_processor, height, width)


def _resized_box(image_processor: Any, height: int, width: int) -> tuple[float, float, float, float]:
    """:func:`processed_box` of a resize (+ centre crop), without padding to a square."""
    size = dict(getattr(image_processor, "size", None) or {})
    if not getattr(image_processor, "do_resize", True) or not size:
        rh, rw = height, width
    elif size.get("shortest_edge") and not size.get("longest_edge"):
        short = size["shortest_edge"]
        if height <= width:
            rh, rw = short, int(short * width / height)
        else:
            rh, rw = int(short * height / width), short
    elif size.get("height") and size.get("width"):
        rh, rw = size["height"], size["width"]
    else:
        raise UnsupportedModelError(f"cannot follow this image processor's resize (size={size}); its geometry is unknown")
    top, left, ch, cw = 0.0, 0.0, rh, rw
    crop = dict(getattr(image_processor, "crop_size", None) or {})
    if getattr(image_processor, "do_center_crop", False) and crop:
        ch, cw = crop["height"], crop["width"]
        top = -((ch - rh) // 2) if ch > rh else int((rh - ch) / 2.0)
        left = -((cw - rw) // 2) if cw > rw else int((rw - cw) / 2.0)
    sy, sx = height / rh, width / rw
    return (top * sy, left * sx, (top + ch) * sy, (left + cw) * sx)
