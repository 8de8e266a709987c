"""One self-contained HTML page from the explorer's data: inline CSS, script and data.

The page loads nothing: images are ``data:`` URIs, arrays are base64 in a JSON block, the
script and styles are inlined from ``static/``, and a Content-Security-Policy forbids any
request (``default-src 'none'``). :func:`external_references` finds any ``src``/``href``/
``url(...)`` that would reach outside the file; :func:`render_page` refuses to emit one.
"""

from __future__ import annotations

import html
import json
import os
import re
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from typing import Any, Union

from ..errors import CaptureError

__all__ = ["render_page", "write_page", "external_references", "ExplorerPage", "COLORMAPS"]

#: Colormaps of the page (names of :func:`vitexplain.viz.colormap_lut`): overlays of
#: non-negative maps, of signed maps (zero at the centre, drawn transparent), and matrices.
COLORMAPS = {"sequential": "jet", "diverging": "bwr", "matrix": "viridis"}

_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
_LOCAL = ("data:", "#", "about:blank")


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Any]]) -> None:
        for name, value in attrs:
            if name in ("src", "href", "srcset", "action", "poster", "data") and value and not value.startswith(_LOCAL):
                self.found.append(f"<{tag} {name}={value[:80]!r}>")
            if name == "style" and value:
                self._css(value)
        self._style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._style = False

    def handle_data(self, data: str) -> None:
        if self._style:
            self._css(data)

    def _css(self, text: str) -> None:
        for ref in re.findall(r"url\(\s*['\"]?([^'\")]*)", text) + re.findall(r"@import\s+['\"]([^'\"]+)", text):
            if not ref.startswith(_LOCAL):
                self.found.append(f"url({ref[:80]!r})")


def external_references(page: str) -> list[str]:
    """Every ``src``/``href``/``srcset``/``action``/``poster``/``data`` attribute and CSS
    ``url()``/``@import`` of an HTML document that is not a ``data:`` URI or a ``#`` fragment."""
    parser = _Links()
    parser.feed(page)
    parser.close()
    return parser.found


#: the page's script files, inlined in this order into one closure (later files use earlier ones)
SCRIPTS = ("common.js", "attention.js", "words.js", "explore.js")


def _static(name: str) -> str:
    return resources.files("vitexplain.explorer").joinpath("static", name).read_text(encoding="utf-8")


def _script() -> str:
    """The page's script: :data:`SCRIPTS` inside one strict-mode closure."""
    return '(function () {\n  "use strict";\n' + "\n".join(_static(n) for n in SCRIPTS) + "})();\n"


def _json(data: Any) -> str:
    """JSON safe inside a ``<script>`` element (no ``</script>``, ``<!--``)."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(images: list[dict[str, Any]], *, title: str = "vitexplain explorer", subtitle: str = "") -> str:
    """The explorer document.

    Args:
        images: per image, the data of :func:`vitexplain.explorer.extract.image_data`.
        title: page title.
        subtitle: one line under the title (e.g. the model).

    Returns:
        The HTML document.

    Raises:
        VitexplainError: the document would reference something outside itself (a bug).
    """
    from ..viz.colormaps import colormap_lut

    payload = {
        "images": images,
        "colormaps": {kind: colormap_lut(name).flatten().tolist() for kind, name in COLORMAPS.items()},
    }
    t = html.escape(title)
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{t}</title><style>{_static('explore.css')}</style></head>\n<body>"
        f"<h1>{t}</h1>"
        f'<div class="vx-top"><span>{html.escape(subtitle)}</span>'
        "<span>Hover a patch to see what it attends to, click to pin it; pick layer, head, "
        "method and class above each view.</span>"
        '<label>overlay <input id="vx-opacity" type="range" min="0" max="100" value="80"></label>'
        '<label><input id="vx-smooth" type="checkbox"> smooth</label></div>\n'
        '<main id="vx-root"></main>\n'
        f'<script type="application/json" id="vx-data">{_json(payload)}</script>\n'
        f"<script>{_script()}</script>\n</body></html>\n"
    )
    outside = external_references(page)
    if outside:
        raise CaptureError(
            f"the explorer page would load something from outside itself: {outside[:5]}; a name or label holds "
            "markup that escaped quoting: please report it"
        )
    return page


class ExplorerPage(type(Path())):  # type: ignore[misc]  # PosixPath / WindowsPath (Python 3.11 cannot subclass Path)
    """The path of a written explorer page, which Jupyter shows inline.

    It is a :class:`pathlib.Path` (``vx.explore`` returned a plain path before): open it, copy it, pass
    it on. ``_repr_html_`` (what a notebook cell displays) is the page itself in an ``<iframe
    srcdoc=...>``: the file as written, HTML-escaped into the attribute, sandboxed with scripts
    allowed and nothing else (no same-origin access, no navigation of the notebook), so its
    Content-Security-Policy still forbids every request.
    """

    #: height of the inline frame in CSS pixels (the page scrolls inside it)
    frame_height = 900

    def _repr_html_(self) -> str:
        page = self.read_text(encoding="utf-8")
        return (f'<iframe class="vx-explorer" sandbox="allow-scripts" title="{html.escape(self.name)}" '
                f'style="width:100%;height:{int(self.frame_height)}px;border:1px solid #ddd" '
                f'srcdoc="{html.escape(page, quote=True)}"></iframe>')


def write_page(path: Union[str, "os.PathLike[str]"], page: str) -> Path:
    """Write the page atomically (temp file + ``os.replace``; a link at ``path`` is replaced, never
    written through); returns the path (an :class:`ExplorerPage`, shown inline by Jupyter).

    Raises:
        OutputError: the folder cannot be written (full disk, read-only, ...).
        UsageError: the name is refused (too long, a folder there, a file in the way of its folder).
    """
    from ..files import write_user_file

    return ExplorerPage(write_user_file(path, page.encode("utf-8"), "page"))
