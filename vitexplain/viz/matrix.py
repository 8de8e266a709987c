"""Attention matrices as labelled heatmaps, and every layer x head map of one query as one image.

``attention_matrix`` draws any (rows, cols) weights with the tokens on both axes and a colour
bar: the classic view of an alignment between target and source tokens, or of a ViT layer's
attention between its tokens. The helpers read the weights and the token names from what
vitexplain captured:

- :func:`record_matrix`: one :class:`~vitexplain.recording.AttentionRecord` (one image, one head
  or the head mean), tokens named ``[CLS]``, ``[DIST]``, ``reg0``... and ``(r,c)`` for patches;
- :func:`caption_matrix`: a :class:`~vitexplain.explainer.CaptionExplanation`, words x patches;
- :func:`head_grid`: every layer x head map of one query token, each on the patch grid.

All figures are (H, W, 3) uint8 RGB drawn with OpenCV (Hershey fonts: ASCII labels).
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any, Optional, Sequence, Union

import cv2
import numpy as np

from ..errors import UsageError
from ._util import image_index as _image_index, map_to_numpy, real, whole
from .colormaps import colormap_lut
from .grids import _ascii, grid

__all__ = ["attention_matrix", "record_matrix", "caption_matrix", "head_grid", "token_labels"]

_FONT = cv2.FONT_HERSHEY_SIMPLEX
_INK = (0, 0, 0)


def _text_image(text: str, scale: float, thick: int) -> np.ndarray:
    """Black text on white, tightly sized: (h, w, 3) uint8."""
    text = _ascii(text)
    (w, h), base = cv2.getTextSize(text, _FONT, scale, thick)
    img = np.full((h + base + 2, w + 2, 3), 255, np.uint8)
    cv2.putText(img, text, (1, h + 1), _FONT, scale, _INK, thick, cv2.LINE_AA)
    return img


def _paste(canvas: np.ndarray, img: np.ndarray, y: int, x: int) -> None:
    """Draw dark-on-white ``img`` onto ``canvas`` at (y, x) (darkest wins), clipped to the canvas."""
    h, w = img.shape[:2]
    y0, x0 = max(y, 0), max(x, 0)
    y1, x1 = min(y + h, canvas.shape[0]), min(x + w, canvas.shape[1])
    if y1 > y0 and x1 > x0:
        region = canvas[y0:y1, x0:x1]
        np.minimum(region, img[y0 - y : y1 - y, x0 - x : x1 - x], out=region)


def _stride(n: int, cell: int, text_h: int, max_labels: int) -> int:
    """Label every k-th row/column so that labels do not overlap and at most ``max_labels`` show."""
    k = max(1, math.ceil((text_h + 2) / max(cell, 1)))
    return max(k, math.ceil(n / max(1, max_labels)))


def _labels(labels: Optional[Sequence[Any]], n: int, what: str) -> list[str]:
    if labels is None:
        return [str(i) for i in range(n)]
    labels = [str(s) for s in labels]
    if len(labels) != n:
        raise UsageError(f"{len(labels)} {what} labels for {n} {what}s of the matrix")
    return labels


def attention_matrix(
    weights: Any,
    row_labels: Optional[Sequence[Any]] = None,
    col_labels: Optional[Sequence[Any]] = None,
    title: Optional[str] = None,
    *,
    cell: Optional[int] = None,
    colormap: str = "viridis",
    vmin: Optional[float] = None,
    vmax: Optional[float] = None,
    max_labels: int = 64,
    font_scale: float = 0.4,
    annotate: bool = False,
) -> np.ndarray:
    """A heatmap of attention weights with labelled axes and a colour bar.

    Rows are queries (e.g. target words), columns keys (e.g. source tokens or patches).
    Column labels are written upright when they fit a cell, rotated by 90 degrees otherwise;
    when labels would overlap (small cells) or there are more than ``max_labels``, every k-th
    one is written (all up to 64 x 64 at the default size).

    Args:
        weights: (R, C) tensor or array (leading singleton dims are squeezed), finite.
        row_labels: R labels (default: 0..R-1).
        col_labels: C labels (default: 0..C-1).
        title: drawn above the matrix.
        cell: side of one cell in pixels, at most ``MAX_SIDE`` in all (default: from the size: from the label height
            (about 15 px) to 40 px up to 64 rows and columns, smaller beyond).
        colormap: a :func:`vitexplain.viz.colormap_names` name.
        vmin: value at the bottom of the colour bar (default: the minimum); below ``vmax``.
        vmax: value at the top (default: the maximum).
        max_labels: most labels per axis (at least 1).
        font_scale: OpenCV font scale of the labels, in (0, ``MAX_FONT_SCALE``].
        annotate: write each value in its cell (when the cell is large enough).

    Returns:
        (H, W, 3) uint8 RGB figure.

    Raises:
        UsageError: weights that are not 2-D / not finite, label counts that do not match, or a size,
            font scale or value range that cannot be drawn.
    """
    m = map_to_numpy(weights)
    n_rows, n_cols = m.shape
    rows, cols = _labels(row_labels, n_rows, "row"), _labels(col_labels, n_cols, "column")
    # a negative font scale made OpenCV write outside the figure (the process crashed), zero drew no labels
    font_scale = real(font_scale, "font_scale", low=0.0, high=MAX_FONT_SCALE, low_open=True)
    max_labels = whole(max_labels, "max_labels")
    thick = 1
    (_, text_h), base = cv2.getTextSize("Ag", _FONT, font_scale, thick)
    side = max(n_rows, n_cols)
    if cell is None or (cell == 0 and not isinstance(cell, bool)):  # every label fits up to 64 per axis; beyond,
        cell = max(text_h + base + 3, min(40, 640 // side)) if side <= 64 else max(2, 960 // side)  # cells shrink
    else:  # (a negative cell was a NumPy error, a huge one tens of GB of pixels)
        cell = whole(cell, "cell", high=max(1, MAX_SIDE // side))
    lo, hi = _value_range(m, vmin, vmax)
    span = hi - lo if hi > lo else 1.0
    lut = colormap_lut(colormap)  # (256, 3) uint8 RGB
    index = np.clip(np.round((m.astype(np.float64) - lo) / span * 255), 0, 255).astype(np.int64)  # (float32 overflowed)
    heat = np.repeat(np.repeat(lut[index], cell, axis=0), cell, axis=1)

    row_step = _stride(n_rows, cell, text_h + base, max_labels)
    col_step = _stride(n_cols, cell, text_h + base, max_labels)
    row_imgs = {i: _text_image(rows[i], font_scale, thick) for i in range(0, n_rows, row_step)}
    col_imgs = {i: _text_image(cols[i], font_scale, thick) for i in range(0, n_cols, col_step)}
    upright = all(img.shape[1] <= cell * col_step for img in col_imgs.values())
    if not upright:
        col_imgs = {i: np.ascontiguousarray(np.rot90(img)) for i, img in col_imgs.items()}
    pad = 6
    left = max((img.shape[1] for img in row_imgs.values()), default=0) + pad
    top_labels = max((img.shape[0] for img in col_imgs.values()), default=0) + pad
    title_img = _text_image(title, font_scale * 1.25, thick) if title else None
    top = pad + (title_img.shape[0] + pad if title_img is not None else 0) + top_labels
    bar_w, bar_gap = 14, 10
    tick_imgs = [_text_image(f"{v:.3g}", font_scale, thick) for v in (hi, (hi + lo) / 2, lo)]
    right = bar_gap + bar_w + 4 + max(img.shape[1] for img in tick_imgs) + pad
    h_heat, w_heat = heat.shape[:2]
    fig = np.full((max(top + h_heat + pad, top + h_heat + tick_imgs[-1].shape[0] // 2 + pad), pad + left + w_heat + right, 3), 255, np.uint8)
    x0 = pad + left
    fig[top : top + h_heat, x0 : x0 + w_heat] = heat
    if title_img is not None:
        _paste(fig, title_img, pad, x0 + (w_heat - title_img.shape[1]) // 2)
    for i, img in row_imgs.items():
        _paste(fig, img, top + i * cell + (cell - img.shape[0]) // 2, x0 - pad // 2 - img.shape[1])
    for i, img in col_imgs.items():
        _paste(fig, img, top - pad // 2 - img.shape[0], x0 + i * cell + (cell - img.shape[1]) // 2)
    if annotate and cell >= 28:
        for r in range(n_rows):
            for c in range(n_cols):
                rgb = lut[index[r, c]].astype(int)
                ink = (0, 0, 0) if rgb.mean() > 128 else (255, 255, 255)
                text = f"{m[r, c]:.2f}"
                (tw, th), _ = cv2.getTextSize(text, _FONT, font_scale * 0.8, 1)
                org = (x0 + c * cell + (cell - tw) // 2, top + r * cell + (cell + th) // 2)
                cv2.putText(fig, text, org, _FONT, font_scale * 0.8, ink, 1, cv2.LINE_AA)
    # colour bar: top = vmax, bottom = vmin, three ticks
    bx = x0 + w_heat + bar_gap
    ramp = np.linspace(255, 0, h_heat).round().astype(np.int64)
    fig[top : top + h_heat, bx : bx + bar_w] = lut[ramp][:, None, :]
    for img, y in zip(tick_imgs, (top, top + h_heat // 2, top + h_heat)):
        _paste(fig, img, y - img.shape[0] // 2, bx + bar_w + 4)
    return fig


#: Largest side of a matrix figure's heat map, in pixels (``cell`` times the longer axis).
MAX_SIDE = 16384
#: Largest font scale of the labels.
MAX_FONT_SCALE = 20.0


def _value_range(m: np.ndarray, vmin: Any, vmax: Any) -> tuple[float, float]:
    """``(lo, hi)``, the values at the bottom and top of the colour bar: ``vmin``/``vmax`` or the data's range.

    Raises:
        UsageError: ``vmin``/``vmax`` not finite numbers, or ``lo >= hi`` when either is given (every cell
            would be drawn in one end colour, and the bar's ticks would not say what the colours mean).
    """
    lo = float(m.min()) if vmin is None else real(vmin, "vmin")
    hi = float(m.max()) if vmax is None else real(vmax, "vmax")
    if (vmin is not None or vmax is not None) and not lo < hi:
        raise UsageError(
            f"vmin ({lo:.4g}) must be below vmax ({hi:.4g}); the weights span [{float(m.min()):.4g}, "
            f"{float(m.max()):.4g}]: leave vmin/vmax out to use that range"
        )
    return lo, hi


def token_labels(layout: Any, num_tokens: Optional[int] = None, *, distilled: bool = False) -> list[str]:
    """Names of a ViT sequence's tokens: ``[CLS]``, ``[DIST]``, ``reg0``..., then ``(r,c)`` per patch.

    Args:
        layout: a :class:`~vitexplain.layout.TokenLayout`.
        num_tokens: the sequence length; when it does not match the layout (e.g. text tokens
            of a decoder), the tokens are numbered ``0..n-1``.
        distilled: the token after the class token is a distillation token (DeiT distilled; implied by a
            layout whose readout is ``"prefix"``, the mean of the class and distillation heads).

    Returns:
        One label per token.
    """
    if layout is None and num_tokens is None:  # (an AttributeError)
        raise UsageError("token_labels needs a layout (rec.layout) or num_tokens")
    n = layout.num_tokens if num_tokens is None else whole(num_tokens, "num_tokens", low=0)
    if layout is None or layout.grid is None or n != layout.num_tokens:
        return [str(i) for i in range(n)]
    prefix: list[str] = []
    if layout.has_class_token:
        prefix.append("[CLS]")
    if (distilled or layout.readout == "prefix") and len(prefix) < layout.num_prefix_tokens:
        prefix.append("[DIST]")
    prefix += [f"reg{i}" for i in range(layout.num_prefix_tokens - len(prefix))]
    gh, gw = layout.grid
    return prefix + [f"({r},{c})" for r in range(gh) for c in range(gw)]


def _is_distilled(model: Any) -> bool:
    return getattr(model, "dist_token", None) is not None or getattr(getattr(model, "config", None), "model_type", "") == "deit"


def record_matrix(
    record: Any,
    *,
    index: int = 0,
    head: Union[None, int, str] = "mean",
    layout: Any = None,
    model: Any = None,
    title: Optional[str] = None,
    **kwargs: Any,
) -> np.ndarray:
    """The attention matrix of one captured call, queries x keys.

    Args:
        record: an :class:`~vitexplain.recording.AttentionRecord`.
        index: which image of the batch.
        head: a head index, or ``"mean"`` / ``"max"`` / ``"min"`` over heads.
        layout: the token layout (``rec.layout``) to name ``[CLS]`` / ``reg`` / ``(r,c)`` tokens;
            without it (or for text tokens) tokens are numbered.
        model: the model, to recognise a DeiT distillation token.
        title: default: the record's name, kind and head.
        **kwargs: passed to :func:`attention_matrix`.

    Returns:
        (H, W, 3) uint8 RGB figure.
    """
    probs = record.probs()[_image_index(index, record.batch_size, "the record")]  # (H, N_q, N_k)
    if hasattr(head, "item") and getattr(head, "ndim", None) == 0:  # a NumPy or 0-d torch integer
        head = head.item()
    if isinstance(head, Integral) and not isinstance(head, bool):
        head = int(head)
        if not -probs.shape[0] <= head < probs.shape[0]:
            raise UsageError(f"head {head} out of range: {record.name!r} has {probs.shape[0]} heads")
        weights, which = probs[head], f"head {head % probs.shape[0]}"
    else:
        from ..recording.scores import fuse_heads

        weights, which = fuse_heads(probs[None], head or "mean")[0], f"heads {head or 'mean'}"
    distilled = _is_distilled(model)
    rows = token_labels(layout, record.num_queries, distilled=distilled) if layout is not None else None
    cols = token_labels(layout, record.num_keys, distilled=distilled) if layout is not None else None
    title = title if title is not None else f"{record.name or 'model'} ({record.kind}, {which})"
    return attention_matrix(weights, rows, cols, title, **kwargs)


def caption_matrix(explanation: Any, index: int = 0, *, title: Optional[str] = None, **kwargs: Any) -> np.ndarray:
    """Words x patches matrix of a caption explanation (each word's map, flattened row-major).

    A vision-language model's explanation (:class:`~vitexplain.results.VLMCaptionExplanation`, whose maps
    are at the image's pixels) gives words x image tokens: each word's ``token_scores``, the image tokens
    the language model sees numbered in its order.

    Args:
        explanation: a :class:`~vitexplain.explainer.CaptionExplanation`.
        index: which image of the batch.
        title: default: the method and the caption.
        **kwargs: passed to :func:`attention_matrix`.

    Returns:
        (H, W, 3) uint8 RGB figure.

    Raises:
        UsageError: ``index`` is not an image of the explanation.
    """
    index = _image_index(index, len(explanation.tokens))
    words = explanation.tokens[index]
    if not words:  # (an empty (0, n) matrix: "expected a non-empty 2-D map")
        raise UsageError(f"caption {index} has no words (the model ended it at once), so there is no words x patches "
                         "matrix to draw")
    title = title if title is not None else f"{explanation.method}: {explanation.captions[index]}"
    token_scores = getattr(explanation, "token_scores", None)
    if token_scores:  # a VLM: (T, n) over its image tokens (its maps are pixels)
        scores = token_scores[index][: len(words)]
        return attention_matrix(scores, words, [str(i) for i in range(scores.shape[-1])], title, **kwargs)
    maps = explanation.maps[index, : len(words)]  # (T, gh, gw)
    gh, gw = maps.shape[-2:]
    cols = [f"({r},{c})" for r in range(gh) for c in range(gw)]
    return attention_matrix(maps.reshape(len(words), gh * gw), words, cols, title, **kwargs)


def head_grid(
    records: Sequence[Any],
    layout: Any,
    *,
    query: int = 0,
    index: int = 0,
    tile: int = 64,
    colormap: str = "viridis",
) -> np.ndarray:
    """Every layer x head attention map of one query token, as one labelled image.

    Each tile is the attention the query pays to the patch tokens, on the patch grid, scaled
    to its own range. Rows are layers (record names), columns heads.

    Args:
        records: self-attention records over the image tokens (e.g. ``rec.select(kind="self")``);
            records whose keys are not the layout's tokens are skipped.
        layout: the token layout (``rec.layout``).
        query: the query token (0: the class token when there is one).
        index: which image of the batch.
        tile: the longer side of each map in pixels (the other follows the grid's aspect ratio).
        colormap: colormap name.

    Returns:
        (H, W, 3) uint8 RGB figure.

    Raises:
        UsageError: no record matches the layout.
    """
    from .colormaps import apply_colormap

    tile = whole(tile, "tile (pixels per map side)", high=4096)  # (0 or less was an OpenCV error)
    if layout is None or getattr(layout, "grid", None) is None:
        raise UsageError("head_grid needs the token layout of the records (rec.layout), with its patch grid")
    if hasattr(query, "item") and getattr(query, "ndim", None) == 0:  # a NumPy or 0-d torch integer
        query = query.item()
    query = whole(query, "query (a token index)", low=-layout.num_tokens, high=layout.num_tokens - 1)
    gh, gw = layout.grid  # (a 3 x 5 grid was stretched into a square tile: cells 12 x 20 px at tile=60)
    size = (max(1, round(tile * gh / max(gh, gw))), max(1, round(tile * gw / max(gh, gw))))
    rows, names = [], []
    for record in records:
        if record.num_keys != layout.num_tokens:
            continue
        probs = record.probs(queries=query)[_image_index(index, record.batch_size, "the record"), :, 0]  # (H, N_k)
        maps = layout.to_grid(probs).detach().cpu().float().numpy()  # (H, gh, gw)
        tiles = []
        for m in maps:
            span = float(m.max() - m.min()) or 1.0
            img = apply_colormap((m - m.min()) / span, colormap)
            tiles.append(cv2.resize(img, (size[1], size[0]), interpolation=cv2.INTER_NEAREST))
        rows.append(tiles)
        names.append(record.name)
    if not rows:
        raise UsageError(
            f"none of the {len(records)} records attends over the layout's {layout.num_tokens} tokens; "
            "pass the image encoder's self-attention records"
        )
    heads = max(len(r) for r in rows)
    return grid(rows, row_labels=names, col_labels=[f"head {h}" for h in range(heads)], font_scale=0.4)
