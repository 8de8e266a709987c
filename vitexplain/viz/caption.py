"""Per-word caption figures: each generated word under its map's overlay."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .grids import grid
from ._util import as_rgb, whole
from .overlays import overlay
from ..errors import UsageError

__all__ = ["caption_figure"]


def caption_figure(
    image: np.ndarray,
    tokens: Sequence[str],
    maps: Any,
    *,
    alpha: float = 0.5,
    colormap: str = "jet",
    normalize: str = "minmax",
    columns: int | None = None,
    tile_size: int | None = 160,
) -> np.ndarray:
    """One RGB image: the input, then one overlay per word with the word as its label.

    Args:
        image: (H, W, 3) uint8 RGB (or a PIL image), the region the model saw.
        tokens: the T words.
        maps: (T', h, w) maps (tensor or array), at least one per word (the first T are drawn).
        alpha: overlay opacity.
        colormap: colormap name.
        normalize: per-word normalisation (``"minmax"``: each word's map spans the colormap).
        columns: tiles per row, at least 1 (default: all words in one row, the image first).
        tile_size: side of each tile in pixels (None: the image size).

    Returns:
        (H', W', 3) uint8 RGB figure.
    """
    image = as_rgb(image)
    tokens = [str(t) for t in tokens]
    if len(maps) < len(tokens):  # (indexing past the maps was an IndexError)
        raise UsageError(f"got {len(maps)} maps for {len(tokens)} words; pass one (h, w) map per word")
    maps_list = [maps[i] for i in range(len(tokens))]
    tiles = [image] + [overlay(image, m, alpha=alpha, colormap=colormap, normalize=normalize) for m in maps_list]
    labels = ["image"] + tokens
    columns = len(tiles) if columns is None else whole(columns, "columns")
    rows = [tiles[i : i + columns] for i in range(0, len(tiles), columns)]
    names = [labels[i : i + columns] for i in range(0, len(labels), columns)]
    rows[-1] = rows[-1] + [None] * (columns - len(rows[-1]))
    names[-1] = names[-1] + [""] * (columns - len(names[-1]))
    # labels under each tile: one labelled row per grid row
    figures = [grid([row], col_labels=label_row, tile_size=(tile_size, tile_size) if tile_size else None) for row, label_row in zip(rows, names)]
    return np.concatenate(figures, axis=0) if len(figures) > 1 else figures[0]
