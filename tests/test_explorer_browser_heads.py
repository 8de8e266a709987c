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


# -- a vision-language model's page --------------------------------------------------------------

@pytest.fixture(scope="module")
def vlm_page(tmp_path_factory):
    from test_explorer_vlm import PROMPT, tiny_llava

    model, processor = tiny_llava()
    image = vx.data.shapes(1, seed=10_905, num_objects=2).images[0]
    path = vx.explore(model, [image], tmp_path_factory.mktemp("vlm") / "vlm.html", processor=processor,
                      prompt=PROMPT, max_len=4, method=["cross", "cross_generic"])
    ex = vx.Explainer(model, processor=processor)
    expected = ex.explain_caption([image], method=["cross", "cross_generic"], prompt=PROMPT, max_len=4)
    ids = expected[0].ids[:, : len(expected[0].tokens[0])]
    with torch.no_grad(), vx.capture(model) as rec:  # the attention rows, straight from the records
        inputs = ex.adapter.prepare([image], [PROMPT])
        ex.adapter.forward_logits(ex.adapter.teacher_inputs(inputs, ids))
    start = inputs["input_ids"].shape[1]
    rows = torch.arange(start - 1, start - 1 + ids.shape[1])
    cols = ex.adapter.image_columns({"input_ids": torch.cat([inputs["input_ids"], ids], 1)})[0]
    att = np.stack([r.probs(queries=rows)[0][..., cols].double().numpy() for r in ex.adapter.lm_records(rec.records)])
    return path, expected, att  # att: (L, H, T, 64)


def test_vlm_page_steps_through_words_layers_and_selected_heads(browser, vlm_page) -> None:
    path, expected, att = vlm_page
    words = expected[0].tokens[0]
    page = Page(browser, path)
    for t in range(len(words)):  # cross, word by word, over the 8 x 8 token grid
        page.page.click(f'button[data-vx="vlm-word"][data-index="{t}"]')
        assert_overlay(page.pixels("piece-map"), expected[0].token_scores[0][t].numpy().reshape(8, 8))
    page.page.click('button[data-vx="vlm-tab"]:text-is("cross_generic")')
    page.page.click('button[data-vx="vlm-word"][data-index="1"]')
    assert_overlay(page.pixels("piece-map"), expected[1].token_scores[0][1].numpy().reshape(8, 8))
    # the overview: every layer x head of word 1's row; two heads at once show their mean
    assert page.page.locator('canvas[data-vx="vlm-tile"]').count() == att.shape[0] * att.shape[1]
    got = page.page.evaluate(
        """() => { const c = document.querySelector('canvas[data-vx="vlm-tile"][data-layer="0"][data-head="2"]');
             const d = c.getContext('2d').getImageData(0, 0, c.width, c.height); return Array.from(d.data); }""")
    assert_tile(np.array(got, dtype=int).reshape(8, 8, 4), att[0, 2, 1].reshape(8, 8))
    page.page.click('canvas[data-vx="vlm-tile"][data-layer="0"][data-head="2"]')
    assert_overlay(page.pixels("piece-map"), att[0, 2, 1].reshape(8, 8))
    page.page.click('canvas[data-vx="vlm-tile"][data-layer="1"][data-head="3"]', modifiers=["Shift"])
    assert_overlay(page.pixels("piece-map"), ((att[0, 2, 1] + att[1, 3, 1]) / 2).reshape(8, 8))
    assert "mean of 2" in page.page.text_content('[data-vx="vlm-selection"]')
    page.page.click('button[data-vx="vlm-next"]')  # the same heads, the next word
    assert_overlay(page.pixels("piece-map"), ((att[0, 2, 2] + att[1, 3, 2]) / 2).reshape(8, 8))
    page.page.click('button[data-vx="piece"][data-index="0"]')  # the grid as a layer: hidden, shown
    assert not page.page.locator('canvas[data-vx="piece-map"]').is_visible()
    page.page.click('button[data-vx="piece"][data-index="0"]')
    assert page.page.locator('canvas[data-vx="piece-map"]').is_visible()
    assert page.close() == []


def _overlay_in_scale(pixels: np.ndarray, values: np.ndarray, m: float) -> None:
    """An overlay canvas drawn with a given largest value ``m`` (several grids in one colour scale)."""
    from test_explorer_browser import _round

    k = np.clip(np.stack([_round(255 * values / m) + d for d in (-1, 0, 1)], -1), 0, 255)
    alpha = pixels[..., 3]
    ok = [any(alpha[idx] == 51 + _round(np.array(0.8 * kk)) and np.abs(pixels[idx][:3] - SEQ[kk]).max()
              <= int(np.ceil(255 / (2 * max(alpha[idx], 1)))) + 1 for kk in k[idx]) for idx in np.ndindex(values.shape)]
    assert all(ok), f"{ok.count(False)} of {values.size} cells differ"


def _vlm_page(build, image, tmp_path, max_len):
    """A VLM's explorer page of one image ("cross", prompt "what is it"), its explanation and token geometry."""
    model, processor = build()
    path = vx.explore(model, [image], tmp_path / "vlm.html", processor=processor, prompt="what is it", max_len=max_len,
                      method="cross")
    ex = vx.Explainer(model, processor=processor)
    e = ex.explain_caption([image], method="cross", prompt="what is it", max_len=max_len)
    view = ex.adapter.views([image], ex.adapter.prepare([image], ["what is it"]))[0]
    return path, e, view, image


def test_vlm_tiles_and_thumbnail_are_layers_over_their_boxes(browser, tmp_path) -> None:
    """Idefics3 (tiles plus a global image): each token grid is drawn over its own box of the image,
    all visible grids in one colour scale; hiding one rescales the others."""
    from vlm_helpers import BUILDERS, images

    path, e, view, image = _vlm_page(BUILDERS["idefics3"], images(3, ((40, 52),))[0], tmp_path, max_len=3)
    assert len(view.pieces) > 1
    scores = e.token_scores[0][0].numpy()  # word 0
    page = Page(browser, path)
    canvases = page.page.locator('canvas[data-vx="piece-map"]')
    assert canvases.count() == len(view.pieces)
    img_box = page.page.locator(".vx-vlm-view img").first.bounding_box()
    m = np.abs(scores).max()
    for i, piece in enumerate(view.pieces):
        box = canvases.nth(i).bounding_box()  # drawn over the piece's box of the image
        y0, x0, y1, x1 = piece.box
        assert abs(box["x"] - img_box["x"] - x0 / 52 * img_box["width"]) < 1.5
        assert abs(box["width"] - (x1 - x0) / 52 * img_box["width"]) < 1.5
        assert abs(box["y"] - img_box["y"] - y0 / 40 * img_box["height"]) < 1.5
        got = page.page.evaluate(
            """i => { const c = document.querySelectorAll('canvas[data-vx="piece-map"]')[i];
                 const d = c.getContext('2d').getImageData(0, 0, c.width, c.height);
                 return [c.height, c.width, Array.from(d.data)]; }""", i)
        pixels = np.array(got[2], dtype=int).reshape(got[0], got[1], 4)
        _overlay_in_scale(pixels, scores[piece.start: piece.start + piece.num_tokens].reshape(piece.grid), m)
    # hide every grid but the last: it is drawn in its own scale
    for i in range(len(view.pieces) - 1):
        page.page.click(f'button[data-vx="piece"][data-index="{i}"]')
    last = view.pieces[-1]
    part = scores[last.start: last.start + last.num_tokens]
    got = page.page.evaluate(
        """() => { const cs = document.querySelectorAll('canvas[data-vx="piece-map"]'); const c = cs[cs.length - 1];
             const d = c.getContext('2d').getImageData(0, 0, c.width, c.height); return [c.height, c.width, Array.from(d.data)]; }""")
    _overlay_in_scale(np.array(got[2], dtype=int).reshape(got[0], got[1], 4), part.reshape(last.grid), np.abs(part).max())
    assert page.close() == []


def test_a_clamped_grid_covers_the_strip_past_its_last_cells(browser, tmp_path) -> None:
    """Florence-2: its token grid sits on DaViT's receptive-field centres (``Piece.clamp``: pixels past the
    box take the edge cells). The page draws that grid one edge-replicated cell larger on every side, so
    the strip past the last centres is overlaid with the edge tokens' colours, as in the saved maps."""
    import encdec_helpers
    from vlm_helpers import images

    path, e, view, image = _vlm_page(encdec_helpers.florence2, images(3, ((40, 52),))[0], tmp_path, max_len=2)
    piece = next(p for p in view.pieces if p.clamp)
    gh, gw = piece.grid
    assert piece.box[2] < image.shape[0] or piece.box[3] < image.shape[1]  # a strip past the last centres
    pooled = next(p for p in view.pieces if not p.clamp)
    scores = e.token_scores[0][0].numpy()  # word 0: the pooled token first, then the grid
    grid = scores[piece.start : piece.start + gh * gw].reshape(gh, gw)
    expected = np.pad(grid, 1, mode="edge")  # the edge cells replicated on every side
    page = Page(browser, path)
    canvases = page.page.locator('canvas[data-vx="piece-map"]')
    i = list(view.pieces).index(piece)
    got = page.page.evaluate(
        """i => { const c = document.querySelectorAll('canvas[data-vx="piece-map"]')[i];
             const d = c.getContext('2d').getImageData(0, 0, c.width, c.height); return [c.height, c.width, Array.from(d.data)]; }""", i)
    pixels = np.array(got[2], dtype=int).reshape(got[0], got[1], 4)
    both = np.abs(np.concatenate([grid.ravel(), scores[pooled.start : pooled.start + 1]])).max()  # one scale
    _overlay_in_scale(pixels, expected, both)
    img = page.page.locator(".vx-vlm-view img").first.bounding_box()
    box = canvases.nth(i).bounding_box()
    h, w = image.shape[:2]
    ch, cw = (piece.box[2] - piece.box[0]) / gh, (piece.box[3] - piece.box[1]) / gw
    assert abs(box["x"] - img["x"] - (piece.box[1] - cw) / w * img["width"]) < 1.5  # one cell beyond the box
    assert abs(box["y"] + box["height"] - img["y"] - (piece.box[2] + ch) / h * img["height"]) < 1.5
    assert box["x"] + box["width"] >= img["x"] + img["width"] - 0.5  # reaches the image's right edge
    assert page.close() == []
