"""Figure of the top-k gated channels of a CNN stage (from the ``channel`` method), as labelled tiles."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from ._util import as_rgb, image_index, whole
from .grids import grid
from .overlays import overlay
from ..errors import UsageError

__all__ = ["channel_tiles"]


def channel_tiles(
    image: Any,
    explanation_or_extras: Any,
    k: int = 8,
    *,
    index: int = 0,
    tile_size: Optional[tuple[int, int]] = None,
    colormap: str = "viridis",
    alpha: float = 0.6,
) -> np.ndarray:
    """The top-k channels of a stage by gate value, one small labelled overlay each.

    The first tile is the image; with an :class:`~vitexplain.Explanation` of the ``channel``
    method, the second is its gate-weighted map ``sum_c g_c X_c``; then one tile per channel
    (its activation X_c, min-max normalised per tile) labelled ``c<index> g=<gate>``.

    Args:
        image: (H, W, 3) uint8 RGB image (or a PIL image) the maps are drawn on.
        explanation_or_extras: an Explanation of method ``"channel"`` or its ``extras`` dict
            (``indices`` (B, k), ``values`` (B, k), ``channel_maps`` (B, k, h, w)).
        k: how many channels to show (at most the number the method returned).
        index: which image of the batch.
        tile_size: (H, W) of each tile; default: the image size, at least 128 px high so the
            labels stay readable.
        colormap: colormap of the channel maps.
        alpha: opacity of the maps over the image.

    Returns:
        (H', W', 3) uint8 RGB figure (one row of tiles).

    Raises:
        ValueError: the extras are not those of the ``channel`` method, or ``k < 1``.
    """
    img = as_rgb(image, "image")
    extras: Mapping[str, Any] = getattr(explanation_or_extras, "extras", explanation_or_extras)
    if not isinstance(extras, Mapping) or not {"indices", "values", "channel_maps"} <= set(extras):
        raise UsageError(
            "channel_tiles needs the result of method 'channel' (an Explanation or its extras with "
            "'indices', 'values' and 'channel_maps')"
        )
    k = whole(k, "k")  # (a string was a TypeError)
    index = image_index(index, len(extras["indices"]))  # (past the batch: an IndexError)
    indices = extras["indices"][index]
    values = extras["values"][index]
    maps = extras["channel_maps"][index]
    k = min(k, int(indices.shape[0]))
    tiles = [img]
    labels = [str(extras.get("module", "image"))]
    maps_attr = getattr(explanation_or_extras, "maps", None)
    if maps_attr is not None:
        tiles.append(overlay(img, maps_attr[index], colormap=colormap, alpha=alpha))
        labels.append("sum g*X")
    for j in range(k):
        tiles.append(overlay(img, maps[j], colormap=colormap, alpha=alpha))
        labels.append(f"c{int(indices[j])} g={float(values[j]):.2f}")
    if tile_size is None:
        h, w = img.shape[:2]
        scale = max(1.0, 128 / h)
        tile_size = (round(h * scale), round(w * scale))
    return grid([tiles], col_labels=labels, tile_size=tile_size)
