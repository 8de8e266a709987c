"""Figure grids (rows = images, columns = methods) and atomic PNG writing, all RGB."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import cv2
import numpy as np

from ._util import as_rgb, check_rgb, pixel_size, real, rgb_color, whole
from ..errors import UsageError

__all__ = ["grid", "save_png"]

_FONT = cv2.FONT_HERSHEY_SIMPLEX


def _as_tile(tile: Any, where: str) -> Optional[np.ndarray]:
    if tile is None:
        return None
    if (hasattr(tile, "convert") and hasattr(tile, "size")) or isinstance(tile, (str, os.PathLike)):
        return as_rgb(tile, where)  # a PIL image of any mode, or a file, as explain() takes them
    arr = np.asarray(tile)
    if arr.ndim == 2 and arr.dtype == np.uint8:
        arr = np.repeat(arr[..., None], 3, axis=2)
    return check_rgb(arr, where)


def _is_tile(item: Any) -> bool:
    """Whether ``item`` is one tile (an image, or None), not a row of them."""
    return (item is None or isinstance(item, (str, os.PathLike)) or (hasattr(item, "convert") and hasattr(item, "size"))
            or getattr(item, "ndim", None) in (2, 3))


def _fit(tile: np.ndarray, size: tuple[int, int], background: int) -> np.ndarray:
    """Resize keeping the aspect ratio and center on a background tile of ``size``."""
    th, tw = size
    h, w = tile.shape[:2]
    if (h, w) == (th, tw):
        return tile
    s = min(th / h, tw / w)
    nh, nw = max(1, min(th, round(h * s))), max(1, min(tw, round(w * s)))
    flag = cv2.INTER_AREA if s < 1 else cv2.INTER_LINEAR
    small = cv2.resize(tile, (nw, nh), interpolation=flag)
    out = np.full((th, tw, 3), background, np.uint8)
    y, x = (th - nh) // 2, (tw - nw) // 2
    out[y : y + nh, x : x + nw] = small
    return out


def _ascii(text: str) -> str:
    # OpenCV's Hershey fonts draw ASCII only
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in str(text))


def _fit_text(text: str, max_w: int, scale: float, thick: int) -> str:
    text = _ascii(text)
    if cv2.getTextSize(text, _FONT, scale, thick)[0][0] <= max_w:
        return text
    while text and cv2.getTextSize(text + "...", _FONT, scale, thick)[0][0] > max_w:
        text = text[:-1]
    return text + "..." if text else ""


def grid(
    images: Sequence[Any],
    *,
    row_labels: Optional[Sequence[str]] = None,
    col_labels: Optional[Sequence[str]] = None,
    pad: int = 4,
    tile_size: Optional[tuple[int, int]] = None,
    background: int = 255,
    text_color: tuple[int, int, int] = (0, 0, 0),
    font_scale: Optional[float] = None,
) -> np.ndarray:
    """Lay images out in a labelled grid, e.g. rows = images, columns = methods.

    Args:
        images: Rows of tiles: ``images[r][c]`` is an ``(H, W, 3)`` uint8 RGB array (a
            2-D uint8 array is taken as gray), a PIL image, an image file's path, or ``None`` for an empty cell. Rows may
            have different lengths. A flat sequence of arrays is one row.
        row_labels: One label per row, drawn left of the row.
        col_labels: One label per column, drawn above it.
        pad: Gap in pixels between tiles and around the figure.
        tile_size: ``(H, W)`` of every cell (an int: a square). Default: the size of the first tile. Tiles
            of another size are resized keeping their aspect ratio and centred.
        background: Gray level of the background and padding.
        text_color: RGB colour of the labels.
        font_scale: OpenCV font scale; default scales with the tile height. Labels are
            ASCII (other characters show as ``?``) and shortened with ``...`` to fit.

    Returns:
        ``(H, W, 3)`` uint8 RGB figure.

    Raises:
        ValueError: No tiles, a tile that is not uint8 RGB, label counts that do not
            match the grid, or a tile size, gray level or font scale out of range.
    """
    if _is_tile(images) and images is not None:
        images = [images]
    rows_in = list(images)
    if rows_in and _is_tile(rows_in[0]):
        rows_in = [rows_in]  # a flat sequence of tiles (arrays, tensors, PIL images) is one row
    rows = [[_as_tile(t, f"images[{r}][{c}]") for c, t in enumerate(row)] for r, row in enumerate(rows_in)]
    n_rows = len(rows)
    n_cols = max((len(r) for r in rows), default=0)
    first = next((t for row in rows for t in row if t is not None), None)
    if first is None:
        raise UsageError("grid needs at least one image")
    row_labels, col_labels = ([labels] if isinstance(labels, str) else labels for labels in (row_labels, col_labels))
    if row_labels is not None and len(row_labels) != n_rows:
        raise UsageError(f"{len(row_labels)} row labels for {n_rows} rows")
    if col_labels is not None and len(col_labels) != n_cols:
        raise UsageError(f"{len(col_labels)} column labels for {n_cols} columns")
    # (a 0 tile size gave an empty figure, a negative one a NumPy error, a negative font scale crashed OpenCV)
    th, tw = pixel_size(tile_size, "tile_size") if tile_size is not None else first.shape[:2]
    pad = whole(pad, "pad", low=0)
    background = whole(background, "background (a gray level)", low=0, high=255)
    scale = real(font_scale, "font_scale", low=0.0, high=20.0, low_open=True) if font_scale is not None else max(0.35, th / 448)
    thick = max(1, round(scale * 1.5))
    (_, text_h), base = cv2.getTextSize("Ag", _FONT, scale, thick)
    line_h = text_h + base

    header = line_h + pad if col_labels is not None else 0
    left = 0
    if row_labels is not None:
        widest = max((cv2.getTextSize(_ascii(s), _FONT, scale, thick)[0][0] for s in row_labels), default=0)
        left = min(widest, 2 * tw) + pad
    H = pad + header + n_rows * (th + pad)
    W = pad + left + n_cols * (tw + pad)
    fig = np.full((H, W, 3), background, np.uint8)
    color = rgb_color(text_color, "text_color")

    for c in range(n_cols):
        x = pad + left + c * (tw + pad)
        if col_labels is not None:
            label = _fit_text(col_labels[c], tw, scale, thick)
            lw = cv2.getTextSize(label, _FONT, scale, thick)[0][0]
            org = (x + (tw - lw) // 2, pad + text_h)
            cv2.putText(fig, label, org, _FONT, scale, color, thick, cv2.LINE_AA)
    for r, row in enumerate(rows):
        y = pad + header + r * (th + pad)
        if row_labels is not None:
            label = _fit_text(row_labels[r], left - pad, scale, thick)
            cv2.putText(fig, label, (pad, y + (th + text_h) // 2), _FONT, scale, color, thick, cv2.LINE_AA)
        for c, tile in enumerate(row):
            if tile is not None:
                x = pad + left + c * (tw + pad)
                fig[y : y + th, x : x + tw] = _fit(tile, (th, tw), background)
    return fig


def save_png(path: "str | os.PathLike[str]", rgb: Any) -> Path:
    """Write an RGB (or gray) uint8 array as a PNG, atomically.

    The PNG is encoded in memory, written to a temporary file in the destination
    directory and moved into place with ``os.replace``, so an interrupted run never
    leaves a half-written file under ``path`` (a link at ``path`` is replaced, never written
    through). Parent directories are created.

    Args:
        path: Destination file (normally ending in ``.png``).
        rgb: ``(H, W, 3)`` uint8 **RGB** array (converted to OpenCV's BGR for
            encoding), or ``(H, W)`` uint8 gray.

    Returns:
        The destination path.

    Raises:
        UsageError: not a uint8 RGB or gray array, OpenCV cannot encode it, or ``path`` cannot be a file (a
            folder, a path below a file).
        OutputError: the folder cannot be written (full disk, read-only, ...).
    """
    arr = np.asarray(rgb)
    if not (arr.ndim == 2 and arr.dtype == np.uint8):
        arr = check_rgb(arr, "rgb")[..., ::-1]
    ok, buf = cv2.imencode(".png", np.ascontiguousarray(arr))
    if not ok:  # pragma: no cover - OpenCV failure
        raise UsageError(f"OpenCV could not encode a PNG of this {arr.shape} {arr.dtype} array for {path}")
    from ..files import write_user_file

    return write_user_file(path, buf.tobytes(), "PNG")

