"""The explorer's layers x heads overview, several heads at once (on a ViT page and on a hierarchical
one, where each layer has its own heads and grids), and the page inline in a notebook
(``_repr_html_``), in a real browser (see tests/test_explorer_browser.py for the set-up, the skip
rule and the colour oracle)."""

from __future__ import annotations

import html

import numpy as np
import pytest
import torch

import vitexplain as vx
from test_explorer_browser import SEQ, Page, _candidates, assert_matrix_row, assert_overlay, browser  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def vit_page(tmp_path_factory):
    image = vx.data.shapes(1, seed=10_611, num_objects=2).images[0]
    model = vx.zoo.load("shapes-vit")
    path = vx.explore(model, [image], tmp_path_factory.mktemp("heads") / "vit.html", method=["rollout"], top_k=1)
    x = vx.Explainer(model).preprocess(image)[0]
    with torch.no_grad(), vx.capture(model) as rec:
        model(x)
    probs = [r.probs()[0].double().numpy() for r in rec.records]  # L x (H, N, N)
    return path, probs, rec.layout


def assert_tile(pixels: np.ndarray, values: np.ndarray) -> None:
    """An overview tile: opaque, the sequential table at round(255 v / max)."""
    ks = _candidates(values.astype(np.float64))
    assert pixels.shape[:2] == values.shape and np.all(pixels[..., 3] == 255)
    bad = [idx for idx in np.ndindex(values.shape) if not any(np.array_equal(pixels[idx][:3], SEQ[k]) for k in ks[idx])]
    assert not bad, f"{len(bad)} of {values.size} tile pixels differ"


def _tile(page: Page, layer: int, head: int) -> np.ndarray:
    got = page.page.evaluate(
        """([l, h]) => { const c = document.querySelector(
               `canvas[data-vx="overview-tile"][data-layer="${l}"][data-head="${h}"]`);
             const d = c.getContext('2d').getImageData(0, 0, c.width, c.height);
             return [c.height, c.width, Array.from(d.data)]; }""",
        [layer, head],
    )
    return np.array(got[2], dtype=int).reshape(got[0], got[1], 4)


def test_overview_shows_every_layer_and_head_of_the_pinned_query(browser, vit_page) -> None:
    path, probs, layout = vit_page
    grid, p = layout.grid, layout.num_prefix_tokens
    page = Page(browser, path)
    assert page.page.locator('canvas[data-vx="overview-tile"]').count() == len(probs) * probs[0].shape[0]
    row, col = grid[0] // 2, 1
    page.click_patch("attn", grid, row, col)
    q = p + row * grid[1] + col
    for layer in (0, len(probs) - 1):
        for head in range(probs[0].shape[0]):
            assert_tile(_tile(page, layer, head), probs[layer][head, q, p:].reshape(grid))
    # a tile click shows that layer and head in the big view and the menus follow
    page.page.click('canvas[data-vx="overview-tile"][data-layer="0"][data-head="3"]')
    assert_overlay(page.pixels("attn"), probs[0][3, q, p:].reshape(grid))
    assert page.page.input_value('select[data-vx="layer"]') == "0"
    assert page.page.input_value('select[data-vx="head"]') == "3"
    assert page.close() == []


def test_several_heads_at_once_show_their_mean(browser, vit_page) -> None:
    path, probs, layout = vit_page
    grid, p = layout.grid, layout.num_prefix_tokens
    page = Page(browser, path)
    page.click_patch("attn", grid, 2, grid[1] - 2)
    q = p + 2 * grid[1] + grid[1] - 2
    page.page.click('canvas[data-vx="overview-tile"][data-layer="1"][data-head="0"]')
    page.page.click('canvas[data-vx="overview-tile"][data-layer="0"][data-head="2"]', modifiers=["Control"])
    page.page.check('input[data-vx="several"]')
    page.page.click('canvas[data-vx="overview-tile"][data-layer="3"][data-head="1"]')
    chosen = [(1, 0), (0, 2), (3, 1)]
    mean = np.mean([probs[l][h, q, p:] for l, h in chosen], axis=0)
    assert_overlay(page.pixels("attn"), mean.reshape(grid))
    assert page.page.input_value('select[data-vx="head"]') == "sel"
    assert "mean of 3" in page.page.text_content('[data-vx="selection"]')
    selected = page.page.locator('canvas[data-vx="overview-tile"].vx-on')
    assert selected.count() == 3
    # clicking a selected tile again (several on) takes it out
    page.page.click('canvas[data-vx="overview-tile"][data-layer="0"][data-head="2"]')
    mean = np.mean([probs[l][h, q, p:] for l, h in ((1, 0), (3, 1))], axis=0)
    assert_overlay(page.pixels("attn"), mean.reshape(grid))
    # the head menu goes back to one pair
    page.page.select_option('select[data-vx="head"]', "2")
    assert_overlay(page.pixels("attn"), probs[3][2, q, p:].reshape(grid))
    assert page.page.locator('canvas[data-vx="overview-tile"].vx-on').count() == 1
    assert page.close() == []


@pytest.fixture(scope="module")
def hier_page(tmp_path_factory):
    """The small timm PVTv2 of tests/test_explorer_stages.py (stages on 16 x 16, 8 x 8, 4 x 4; the
    first stage's keys pooled to 8 x 8; 1, 2, 4, 4 heads) and its per-layer attention from capture."""
    pytest.importorskip("vitexplain.methods.resample", reason="needs the hierarchical family (issue 23)")
    from test_explorer_stages import _oracle, _pvt

    model = _pvt()
    image = vx.data.shapes(1, seed=10_883, num_objects=2).images[0]
    path = vx.explore(model, [image], tmp_path_factory.mktemp("hier-heads") / "hier.html", method=["rollout"], top_k=1)
    geometry, probs, _ = _oracle(model, vx.Explainer(model).preprocess(image)[0])
    return path, geometry, probs


def test_overview_and_several_heads_on_a_hierarchical_page(browser, hier_page) -> None:
    path, geometry, probs = hier_page
    page = Page(browser, path)
    assert page.page.locator('canvas[data-vx="overview-tile"]').count() == sum(p.shape[0] for p in probs) == 11
    # one point of the image: on each layer the query is the patch of its own query grid under it
    page.click_patch("attn", (16, 16), 5, 9)
    point = ((5 + 0.5) / 16, (9 + 0.5) / 16)
    query = [int(point[0] * g[0]) * g[1] + int(point[1] * g[1]) for g, _ in geometry]
    for layer, (_, keys) in enumerate(geometry):  # every tile on its layer's own key grid
        for head in range(probs[layer].shape[0]):
            assert_tile(_tile(page, layer, head), probs[layer][head, query[layer]].reshape(keys))
    # a tile click shows that pair alone, on its key grid (8 x 8 keys pooled from 16 x 16 queries)
    page.page.click('canvas[data-vx="overview-tile"][data-layer="0"][data-head="0"]')
    assert_overlay(page.pixels("attn"), probs[0][0, query[0]].reshape(8, 8))
    assert page.page.input_value('select[data-vx="layer"]') == "0"
    # several pairs of the last stage (same 4 x 4 query and key sets), across two layers: their mean
    page.page.click('canvas[data-vx="overview-tile"][data-layer="2"][data-head="1"]')
    page.page.click('canvas[data-vx="overview-tile"][data-layer="3"][data-head="3"]', modifiers=["Control"])
    page.page.check('input[data-vx="several"]')
    page.page.click('canvas[data-vx="overview-tile"][data-layer="3"][data-head="0"]')
    mean = np.mean([probs[l][h, query[l]] for l, h in ((2, 1), (3, 3), (3, 0))], axis=0)
    assert_overlay(page.pixels("attn"), mean.reshape(4, 4))
    matrix = page.pixels("matrix")
    assert matrix.shape[:2] == (16, 16)
    assert_matrix_row(matrix[query[3]], mean)
    assert page.page.input_value('select[data-vx="head"]') == "sel"
    assert "mean of 3" in page.page.text_content('[data-vx="selection"]')
    # a pair on other grids (layer 1: 8 x 8) is not averaged in: refused, said, the view unchanged
    page.page.click('canvas[data-vx="overview-tile"][data-layer="1"][data-head="1"]')
    assert "not added" in page.page.text_content('[data-vx="selection"]')
    assert page.page.locator('canvas[data-vx="overview-tile"].vx-on').count() == 3
    assert page.page.locator('canvas[data-vx="overview-tile"].vx-apart').count() == 1 + 2
    assert_overlay(page.pixels("attn"), mean.reshape(4, 4))
    # the menus go back to one layer: layer 1's head menu has its 2 heads and their mean
    page.page.select_option('select[data-vx="layer"]', "1")
    page.page.select_option('select[data-vx="head"]', "mean")
    assert_overlay(page.pixels("attn"), probs[1][:, query[1]].mean(0).reshape(8, 8))
    assert "mean of 2" in page.page.text_content('[data-vx="selection"]')
    assert page.page.locator('canvas[data-vx="overview-tile"].vx-on').count() == 2
    assert page.close() == []


def test_inline_notebook_frame_draws_the_page_and_requests_nothing(browser, vit_page, tmp_path) -> None:
    path = vit_page[0]
    frame_html = path._repr_html_()
    wrapper = tmp_path / "notebook.html"
    wrapper.write_text(f"<!DOCTYPE html><html><body><h1>cell output</h1>{frame_html}</body></html>", encoding="utf-8")
    page = vx_page = browser.new_page()
    requests: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(wrapper.as_uri())
    frame = page.frame_locator("iframe.vx-explorer")
    frame.locator("body[data-vx-ready='1']").wait_for(timeout=30_000)
    assert frame.locator('canvas[data-vx="attn"]').count() == 1
    assert frame.locator('canvas[data-vx="overview-tile"]').count() > 1
    vx_page.close()
    assert not errors, errors
    assert [u for u in requests if u != wrapper.as_uri() and not u.startswith(("data:", "about:"))] == []
    assert html.unescape(frame_html.split('srcdoc="', 1)[1].rsplit('"></iframe>', 1)[0]) == path.read_text("utf-8")
