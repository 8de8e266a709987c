"""Pixel relevance summed onto a VLM's image tokens: each token's cell of a token grid that tiles the pixels.

The adapters' :meth:`~vitexplain.adapters.vlm.base.VLMAdapter.lrp_tokens` use these: AttnLRP and CP-LRP carry
relevance back to the pixels the model was given, (.., H, W), and a token's relevance is the sum over the pixels it
reads: one grid over a whole image (:func:`sum_cells`), or grids over pieces (tiles, a global image) taken in order,
per image (:func:`piece_tokens`) or over a batch's pieces (:func:`batch_piece_tokens`).
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from ...errors import UnsupportedModelError

__all__ = ["sum_cells", "piece_tokens", "batch_piece_tokens"]


def sum_cells(relevance: Tensor, grid: tuple[int, int], what: str) -> Tensor:
    """(N, T, H, W) pixel relevance summed over each cell of a (gh, gw) token grid that tiles the pixels evenly:
    (N, T, gh * gw), row-major (the pixels past the last whole cell, which no token reads, are left out).

    Raises:
        UnsupportedModelError: the grid has more cells than pixels (``what`` names the model).
    """
    n, t, h, w = relevance.shape
    gh, gw = grid
    if gh < 1 or gw < 1 or h < gh or w < gw:
        raise UnsupportedModelError(f"{what}: a {gh} x {gw} token grid does not fit its {h} x {w} pixels")
    ch, cw = h // gh, w // gw
    cells = relevance[..., : gh * ch, : gw * cw].reshape(n, t, gh, ch, gw, cw).sum(dim=(3, 5))
    return cells.reshape(n, t, gh * gw)


def piece_tokens(pieces: Tensor, n: int, grid: tuple[int, int], what: str, image: int, piece: str = "piece") -> Tensor:
    """One image's tokens from its pieces' pixel relevance: (T, P, H, W) -> (T, n), the first ``n / (gh gw)`` pieces
    (tiles, a global image; the batch's padding pieces after them are left out), each cell of the (gh, gw) token grid
    summed (:func:`sum_cells`), pieces in order.

    Raises:
        UnsupportedModelError: ``n`` is not a whole number of the pieces held in the pixels (``what`` names the model,
            ``image`` the image, ``piece`` what a piece is called).
    """
    per_piece = grid[0] * grid[1]
    count = n // per_piece
    if n % per_piece or count > pieces.shape[1]:
        raise UnsupportedModelError(f"{what}: image {image} has {n} image tokens, not a whole number of the "
                                    f"{per_piece}-token {piece}s held in its {pieces.shape[1]} pixel {piece}s; use the "
                                    "model's own processor")
    cells = sum_cells(pieces[:, :count].transpose(0, 1), grid, what)  # (count, T, per_piece)
    return cells.transpose(0, 1).reshape(pieces.shape[0], n)


def batch_piece_tokens(relevance: Tensor, counts: Sequence[int], grid: tuple[int, int], what: str) -> list[Tensor]:
    """Per image, its tokens from the batch's pieces taken in order (P, T, H, W) -> (T, n_b): ``n_b / (gh gw)``
    pieces for image b, each cell of the (gh, gw) token grid summed (:func:`sum_cells`).

    Raises:
        UnsupportedModelError: the tokens are not whole grids, or not as many pieces as the pixels hold (``what``
            names the model).
    """
    per_piece = grid[0] * grid[1]
    pieces = [n // per_piece for n in counts]
    if any(n % per_piece for n in counts) or sum(pieces) != relevance.shape[0]:
        raise UnsupportedModelError(f"{what}: {list(counts)} image tokens are not the {relevance.shape[0]} pixel pieces "
                                    f"of a {grid[0]} x {grid[1]} grid each; use the model's own processor")
    cells = sum_cells(relevance, grid, what)  # (P, T, per_piece)
    return [part.transpose(0, 1).reshape(part.shape[1], -1) for part in cells.split(pieces)]
