"""Explanations display themselves: Jupyter HTML with inline PNGs, ``.show()`` with matplotlib."""

from __future__ import annotations

import base64
import io
import re
import sys

import numpy as np
import pytest
from PIL import Image

import vitexplain as vx
from vitexplain.viz import colormap_lut


@pytest.fixture(scope="module")
def batch():
    return vx.data.shapes(2, seed=10_611)


def _pngs(page: str) -> list[np.ndarray]:
    uris = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(u))).convert("RGB")) for u in uris]


def test_explanation_html_shows_enlarged_labelled_overlays_with_a_colour_bar(batch) -> None:
    ex = vx.Explainer(vx.zoo.load("shapes-vit"))
    e = ex.explain(list(batch.images), method="cdam")
    page = e._repr_html_()
    tiles = _pngs(page)
    assert len(tiles) == 2
    for i, tile in enumerate(tiles):
        assert tile.shape[1] >= 256 and tile.shape[0] > 256  # 64 px input enlarged; colour bar below
        assert f"cdam, target {e.target_names()[i]}" in page
        bar = tile[258]  # the first row of the bar under the 256 px overlay: the diverging map
        np.testing.assert_array_equal(bar[0], colormap_lut("bwr")[0])
        np.testing.assert_array_equal(bar[-1], colormap_lut("bwr")[255])


def test_caption_explanation_html_has_every_word(batch) -> None:
    ex = vx.Explainer(vx.zoo.load("shapes-captioner"))
    e = ex.explain_caption(list(batch.images[:1]), method="cross")
    page = e._repr_html_()
    words = e.tokens[0]
    assert len(_pngs(page)) == 1 + len(words)
    for t, word in enumerate(words):
        assert f"{t + 1}. {word} (cross)" in page


def test_show_draws_with_matplotlib(batch) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    ex = vx.Explainer(vx.zoo.load("shapes-vit"))
    e = ex.explain(list(batch.images), method="generic")
    fig = e.show()
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == [f"image {i}: generic, target {n}" for i, n in enumerate(e.target_names())]


def test_show_without_matplotlib_says_how_to_install(batch, monkeypatch) -> None:
    ex = vx.Explainer(vx.zoo.load("shapes-vit"))
    e = ex.explain(list(batch.images[:1]), method="rollout")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(vx.UsageError, match="pip install matplotlib"):
        e.show()

