"""A static HTML gallery of exported overlays (rows: images, columns: methods).

The page is one self-contained ``index.html`` (inline CSS, no script, no server): every image
is a relative, percent-encoded link, so the folder can be opened from disk, zipped or served
as it is. Names, labels and errors are HTML-escaped.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union
from numbers import Real
from urllib.parse import quote

from ..errors import UsageError
from ._util import whole

__all__ = ["write_gallery", "render_gallery"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.2em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .3em} p.meta{color:#555;margin:.2em 0 1em}
table{border-collapse:collapse;background:#fff}
th,td{border:1px solid #ddd;padding:6px;vertical-align:top;text-align:left}
th{position:sticky;top:0;background:#f0f0f0;z-index:1}
td.name{max-width:16em;word-break:break-all;font-family:ui-monospace,monospace;font-size:.85em}
td.failed{background:#fff0f0;color:#a00}
img{width:var(--w,256px);height:auto;display:block;image-rendering:auto}
img.small{image-rendering:pixelated}
.pred{font-size:.85em;white-space:nowrap} .score{color:#777}
.cap{font-size:.8em;color:#333;margin-top:2px}
"""


def _href(rel: str) -> str:
    """Percent-encode a relative posix path for href/src (keeps ``/``; spaces, ``#``, ``?``,
    ``%`` and non-ASCII are encoded; undecodable file names keep their original bytes)."""
    return quote(rel.encode("utf-8", "surrogateescape"), safe="/")


def _text(value: Any) -> str:
    s = str(value)
    s = s.encode("utf-8", "replace").decode("utf-8") if _has_surrogates(s) else s
    return html.escape(s, quote=True)


def _has_surrogates(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _input_href(record: dict[str, Any], folder: Path) -> Optional[str]:
    """The link to a record's input, relative to ``folder``. A path whose bytes are not UTF-8 is
    read from ``source.path_bytes_hex`` (its JSON text holds ``\\xNN`` instead of the bytes)."""
    source = record.get("source") or {}
    path = source.get("path") if isinstance(source, dict) else None
    if not path:
        return None
    raw = source.get("path_bytes_hex")
    if isinstance(raw, str):
        try:
            path = os.fsdecode(bytes.fromhex(raw))  # the real name (surrogate escapes for its bytes)
        except ValueError:
            pass
    try:
        return _href(os.path.relpath(path, folder).replace(os.sep, "/"))
    except ValueError:  # another drive (Windows): an absolute file URI
        return Path(path).as_uri()


def _prediction(record: dict[str, Any]) -> str:
    preds = record.get("predictions") or []
    if not preds:
        return ""
    top = preds[0]
    name = top.get("label") if top.get("label") is not None else top.get("index")
    score = top.get("score", 0.0)
    shown = f"{float(score):.3f}" if isinstance(score, Real) and not isinstance(score, bool) else _text(score)
    return f'{_text(name)} <span class="score">{shown}</span>'


def _target(record: dict[str, Any]) -> str:
    target = record.get("target") or {}
    if not target:
        return ""
    name = target.get("label") if target.get("label") is not None else target.get("index")
    return _text(name)


def _small(record: dict[str, Any], thumb_px: int) -> str:
    """``class="small"`` for an input smaller than its thumbnail (drawn with crisp pixels)."""
    width = record.get("width")
    return ' class="small"' if isinstance(width, int) and 0 < width < thumb_px else ""


def _records(records: Any) -> list[dict[str, Any]]:
    """``records`` as a list of manifest records (dicts whose ``files`` is a dict).

    Raises:
        UsageError: not an iterable of such dicts (an AttributeError or TypeError deep in the page before).
    """
    if records is None or isinstance(records, (str, bytes, dict)) or not hasattr(records, "__iter__"):
        raise UsageError(f"records must be a list of manifest records (dicts), got {type(records).__name__}")
    out = list(records)
    for i, r in enumerate(out):
        if not isinstance(r, dict) or not isinstance(r.get("files") or {}, dict):
            raise UsageError(f"record {i} is not a manifest record (a dict with 'key', 'status', 'files': {{method: "
                             f"{{'overlay': path}}}}): got {type(r).__name__} {str(r)[:80]!r}")
    return out


def render_gallery(
    records: Iterable[dict[str, Any]],
    *,
    folder: Union[str, "os.PathLike[str]"],
    methods: Optional[Sequence[str]] = None,
    title: str = "vitexplain",
    thumb_px: int = 256,
) -> str:
    """The gallery page as a string.

    Args:
        records: manifest records (see :func:`vitexplain.export.export`): ``key``, ``status``,
            ``files`` ({method: {"overlay": rel path}}), ``predictions``, ``target``, ``error``,
            ``source``.
        folder: where the page will live (links are relative to it; file paths in records are
            relative to it too).
        methods: column order; default: every method found in the records, in first-seen order.
        title: page title.
        thumb_px: displayed width of each image.

    Returns:
        The HTML document.
    """
    folder = Path(folder).resolve()
    records = _records(records)
    if not isinstance(title, str):  # (an AttributeError from the HTML escaping)
        raise UsageError(f"title must be a string, got {type(title).__name__} {title!r}")
    thumb_px = whole(thumb_px, "thumb_px (displayed image width)", high=4096)  # (a string was a ValueError)
    if isinstance(methods, str):  # one method: its name, not its letters as columns
        methods = [methods]
    if methods is None:
        methods = list(dict.fromkeys(m for r in records for m in (r.get("files") or {})))
    else:
        extra = [m for r in records for m in (r.get("files") or {}) if m not in methods]
        methods = [*methods, *dict.fromkeys(extra)]
    ok = sum(r.get("status") == "ok" for r in records)
    failed = len(records) - ok
    head = "".join(f"<th>{_text(m)}</th>" for m in methods)
    rows = []
    for r in records:
        name = _text(r.get("key", ""))
        src = _input_href(r, folder)
        name_cell = f'<a href="{src}">{name}</a>' if src else name
        if r.get("status") != "ok":
            rows.append(
                f'<tr><td class="name">{name_cell}</td><td class="failed" colspan="{len(methods) + 3}">'
                f'{_text(r.get("error") or "failed")}</td></tr>'
            )
            continue
        thumb = f'<a href="{src}"><img src="{src}" alt="input" loading="lazy"{_small(r, thumb_px)}></a>' if src else ""
        cells = []
        files = r.get("files") or {}
        target = _target(r)
        for m in methods:
            entry = files.get(m) or {}
            rel = entry.get("overlay")
            if rel:
                href = _href(str(rel))
                caption = f'<div class="cap">{_text(m)}: {target}</div>' if target else ""
                cells.append(f'<td><a href="{href}"><img src="{href}" alt="{_text(m)}" loading="lazy"></a>{caption}</td>')
            else:
                cells.append("<td></td>")
        rows.append(
            f'<tr><td class="name">{name_cell}</td><td>{thumb}</td>'
            f'<td class="pred">{_prediction(r)}</td><td class="pred">{_target(r)}</td>{"".join(cells)}</tr>'
        )
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{_text(title)}</title><style>{_CSS}</style></head>\n"
        f'<body style="--w:{int(thumb_px)}px"><h1>{_text(title)}</h1>'
        f'<p class="meta">{len(records)} images: {ok} ok, {failed} failed. Columns: input, top '
        "prediction (score), explained target, then one overlay per method, each explaining that target "
        "(signed maps such as cdam: red = evidence for it, blue = against, clear = none).</p>\n"
        f"<table><thead><tr><th>image</th><th>input</th><th>prediction</th><th>target</th>{head}</tr></thead>\n<tbody>\n"
        + "\n".join(rows)
        + "\n</tbody></table></body></html>\n"
    )


def write_gallery(
    path: Union[str, "os.PathLike[str]"],
    records: Iterable[dict[str, Any]],
    *,
    methods: Optional[Sequence[str]] = None,
    title: str = "vitexplain",
    thumb_px: int = 256,
) -> Path:
    """Write :func:`render_gallery` to ``path`` atomically (temp file + ``os.replace``).

    Args:
        path: the ``index.html`` to write; record file paths are relative to its folder.
        records: manifest records.
        methods: column order (default: as found).
        title: page title.
        thumb_px: displayed image width.

    Returns:
        The path written.
    """
    from ..files import check_file_path, write_user_file

    check_file_path(path, "gallery")
    dest = Path(path)
    page = render_gallery(records, folder=dest.parent, methods=methods, title=title, thumb_px=thumb_px)
    return write_user_file(dest, page.encode("utf-8", "replace"), "gallery")
