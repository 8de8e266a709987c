"""How explanations show themselves: inline HTML in Jupyter, matplotlib figures with ``show()``.

``Explanation._repr_html_`` and ``CaptionExplanation._repr_html_`` (called by Jupyter) lay out
labelled overlays as inline PNGs; ``.show()`` draws the same tiles with matplotlib (imported
only then; a clear error says how to install it when it is missing). Small inputs are shown
enlarged (:func:`readable`) so that a 64 px image reads at a glance.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..errors import UsageError
from .colormaps import apply_colormap
from .legend import with_colorbar
from .overlays import normalize_map, readable

__all__ = ["png_data_uri", "explanation_tiles", "caption_tiles", "tiles_html", "show_tiles"]

def png_data_uri(image: np.ndarray) -> str:
    """An (H, W, 3) uint8 RGB image as a ``data:image/png;base64,...`` URI."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image)).save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _source(e: Any, i: int) -> str:
    sources = getattr(e, "sources", None) or []
    source = sources[i] if i < len(sources) else None
    return Path(str(source)).name if source is not None else f"image {i}"


def _map_tile(image: Optional[np.ndarray], m: Any, signed: bool) -> np.ndarray:
    """Overlay of map ``m`` on ``image`` (or the coloured map alone), enlarged, with a colour bar."""
    from .overlays import overlay

    values = m.detach().cpu().float().numpy() if hasattr(m, "detach") else np.asarray(m, np.float32)
    mode = "signed" if signed else "minmax"
    if image is not None:
        tile = overlay(readable(image), values, normalize=mode, alpha=0.6 if signed else 0.5)
    else:
        tile = readable(apply_colormap(normalize_map(values, mode), "bwr" if signed else "jet"))
    if signed:
        return with_colorbar(tile, signed=True, scale=float(np.abs(values).max()))
    # minmax: the bottom colour is the map's minimum (the bar said 0: a map spanning 0.4..0.6 read as 0..0.6)
    return with_colorbar(tile, signed=False, scale=float(values.max()), low=float(values.min()))


def explanation_tiles(e: Any, max_images: int = 12) -> list[tuple[np.ndarray, str]]:
    """Per image of an :class:`~vitexplain.Explanation` (at most ``max_images``): its overlay
    (or map) with a colour bar, and a label ``name: method, target``."""
    names = e.target_names()
    out = []
    for i in range(min(len(e), max_images)):
        image = e.images[i] if e.images is not None else None
        label = f"{_source(e, i)}: {e.method}, target {names[i]}"
        out.append((_map_tile(image, e.maps[i], e.signed), label))
    return out


def caption_tiles(e: Any, max_images: int = 4) -> list[list[tuple[np.ndarray, str]]]:
    """Per image of a :class:`~vitexplain.CaptionExplanation`: the image, then one overlay per
    word, each with its label."""
    rows = []
    for i in range(min(len(e), max_images)):
        image = e.images[i] if e.images is not None else None
        row = [(readable(image), f"{_source(e, i)}: {e.captions[i]!r}")] if image is not None else []
        for t, word in enumerate(e.tokens[i]):
            row.append((_map_tile(image, e.maps[i, t], bool(getattr(e, "signed", False))), f"{t + 1}. {word} ({e.method})"))
        rows.append(row)
    return rows


def tiles_html(rows: list[list[tuple[np.ndarray, str]]], note: str = "") -> str:
    """Rows of labelled tiles as HTML with inline PNGs (what Jupyter displays)."""
    figure = (
        '<figure style="margin:0 6px 6px 0;display:inline-block;vertical-align:top">'
        '<img src="{src}" style="width:{w}px;image-rendering:pixelated" alt="{alt}">'
        '<figcaption style="font:12px sans-serif;max-width:{w}px;word-break:break-word">{alt}</figcaption></figure>'
    )
    body = "".join(
        "<div>" + "".join(figure.format(src=png_data_uri(t), w=min(t.shape[1], 320), alt=html.escape(label)) for t, label in row) + "</div>"
        for row in rows
    )
    tail = f'<div style="font:12px sans-serif;color:#666">{html.escape(note)}</div>' if note else ""
    return f"<div>{body}{tail}</div>"


def show_tiles(rows: list[list[tuple[np.ndarray, str]]]) -> Any:
    """Draw rows of labelled tiles with matplotlib; returns the figure.

    Raises:
        UsageError: matplotlib is not installed.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "show() draws with matplotlib, which is not installed: `pip install matplotlib`; in "
            "Jupyter the explanation also displays itself (put it last in a cell), and "
            ".overlay(i) returns the RGB array"
        ) from None
    cols = max(len(r) for r in rows)
    fig, axes = plt.subplots(len(rows), cols, figsize=(3.2 * cols, 3.6 * len(rows)), squeeze=False)
    for r, row in enumerate(rows):
        for c in range(cols):
            ax = axes[r][c]
            ax.axis("off")
            if c < len(row):
                ax.imshow(row[c][0], interpolation="nearest")
                ax.set_title(row[c][1], fontsize=9)
    fig.tight_layout()
    if "agg" not in plt.get_backend().lower():
        plt.show()
    return fig
