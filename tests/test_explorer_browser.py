"""The explorer page in a real browser: Debian's chromium, headless, driven by Playwright.

Each test loads a page from a file:// URL, waits for ``data-vx-ready``, clicks what a person
clicks, and reads the drawn canvas pixels back (``getImageData``). The oracle is the attention
the Python side computes independently (``vx.capture`` records' ``probs()``, rollout written
out here with numpy, the Explainer's maps), passed through the page's documented colouring
(static/common.js, ``colour``): lookup index ``k = round(255 v / max)`` of the page's colormap, and
for overlays alpha ``51 + round(0.8 k)``. The tolerance comes from the quantisation step: the
page stores ``round(255 v / s)`` per row part, so its index may differ by one from the one
computed here from float values; overlay pixels with alpha < 255 also go through the canvas's
premultiplied 8-bit storage, which moves a channel by at most ``255 / (2 alpha) + 1``.

Without chromium (or Playwright) these tests skip with a one-line reason saying how to enable
them (``apt-get install chromium``, or ``VX_CHROMIUM=/path/to/chromium``); under CI (``CI=true``,
which ``.ci/run`` exports after installing chromium) a missing browser fails them instead.
"""

from __future__ import annotations

import io
import os
import shutil

import numpy as np
import pytest
from peers import missing
import torch

import vitexplain as vx
from vitexplain.explorer.page import COLORMAPS
from vitexplain.viz import colormap_lut

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
SEQ = colormap_lut(COLORMAPS["sequential"]).astype(int)
MAT = colormap_lut(COLORMAPS["matrix"]).astype(int)


_missing = missing  # skip with the reason; under CI (CI=true) fail: there the browser must be there


def _chromium() -> str:
    """The chromium to drive: ``$VX_CHROMIUM``, else ``chromium`` or ``chromium-browser`` on the PATH."""
    path = os.environ.get("VX_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        _missing("chromium is not installed: `apt-get install chromium` (or set VX_CHROMIUM=/path/to/chromium) "
                 "to run the explorer's browser tests")
    return path


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("Playwright is not installed: `pip install '.[test]'` to run the explorer's browser tests")
    return sync_playwright


@pytest.mark.parametrize("ci, outcome", [(None, pytest.skip.Exception), ("true", pytest.fail.Exception)])
def test_a_missing_chromium_skips_saying_how_to_enable_it_and_fails_under_ci(monkeypatch, ci, outcome) -> None:
    monkeypatch.delenv("VX_CHROMIUM", raising=False)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no chromium on the PATH
    with pytest.raises(outcome, match="apt-get install chromium") as caught:
        _chromium()
    assert "\n" not in str(caught.value)  # one line


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    executable = _chromium()
    sync_playwright = _playwright()

    pw = sync_playwright().start()
    context = pw.chromium.launch_persistent_context(
        str(tmp_path_factory.mktemp("chromium-profile")), executable_path=executable, headless=True,
        args=FLAGS, viewport={"width": 1300, "height": 1000},
    )
    yield context
    context.close()
    pw.stop()


class Page:
    """One loaded explorer page, with the requests it made and the script errors it raised."""

    def __init__(self, context, path) -> None:
        self.url = path.as_uri()
        self.page = context.new_page()
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(self.url)
        self.page.wait_for_selector("body[data-vx-ready='1']", timeout=30_000)

    def pixels(self, role: str) -> np.ndarray:
        """(h, w, 4) RGBA of the first canvas with ``data-vx=role``."""
        got = self.page.evaluate(
            """role => { const c = document.querySelector(`canvas[data-vx="${role}"]`);
                 const d = c.getContext('2d').getImageData(0, 0, c.width, c.height);
                 return [c.height, c.width, Array.from(d.data)]; }""",
            role,
        )
        return np.array(got[2], dtype=int).reshape(got[0], got[1], 4)

    def click_patch(self, role: str, grid: tuple[int, int], row: int, col: int) -> None:
        view = self.page.locator(f'.vx-view:has(canvas[data-vx="{role}"])').first
        box = view.bounding_box()
        view.click(position={"x": (col + 0.5) * box["width"] / grid[1], "y": (row + 0.5) * box["height"] / grid[0]})

    def close(self) -> list[str]:
        """The URLs requested besides the page itself and data: URIs (must be none)."""
        self.page.close()
        assert not self.errors, self.errors
        return [u for u in self.requests if u != self.url and not u.startswith("data:")]


def _round(x: np.ndarray) -> np.ndarray:
    return np.floor(x + 0.5).astype(int)  # JavaScript's Math.round


def _candidates(values: np.ndarray) -> np.ndarray:
    """Per value, the lookup indices the page may draw: round(255 v / max) and its neighbours."""
    m = np.abs(values).max()
    assert m > 0
    k = _round(255 * values / m)
    return np.clip(np.stack([k - 1, k, k + 1], axis=-1), 0, 255)


def assert_overlay(pixels: np.ndarray, values: np.ndarray) -> None:
    """An overlay canvas (one pixel per patch) shows ``values`` (gh, gw), non-negative."""
    ks = _candidates(values.astype(np.float64))
    assert pixels.shape[:2] == values.shape
    alpha = pixels[..., 3]
    bad = []
    for idx in np.ndindex(values.shape):
        a = alpha[idx]
        tol = int(np.ceil(255 / (2 * max(a, 1)))) + 1
        ok = any(
            a == 51 + _round(np.array(0.8 * k)) and np.abs(pixels[idx][:3] - SEQ[k]).max() <= tol
            for k in ks[idx]
        )
        if not ok:
            bad.append((idx, pixels[idx].tolist(), ks[idx].tolist()))
    assert not bad, f"{len(bad)} of {values.size} patches differ, e.g. {bad[:3]}"


def assert_matrix_row(pixels: np.ndarray, values: np.ndarray) -> None:
    """An opaque matrix row (colours of the matrix colormap, scaled to the row's max)."""
    ks = _candidates(values.astype(np.float64))
    assert np.all(pixels[:, 3] == 255)
    ok = [any(np.array_equal(pixels[j, :3], MAT[k]) for k in ks[j]) for j in range(len(values))]
    assert all(ok), f"{ok.count(False)} of {len(values)} matrix cells differ"


def _rollout(probs: list[np.ndarray]) -> list[np.ndarray]:
    """Cumulative rollout after each layer, written out: A_hat = rownorm(0.5 mean_h(A) + 0.5 I)."""
    out, r = [], None
    for a in probs:
        hat = 0.5 * a.mean(axis=0) + 0.5 * np.eye(a.shape[-1])
        hat = hat / hat.sum(axis=-1, keepdims=True)
        r = hat if r is None else hat @ r
        out.append(r)
    return out


# -- pages --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def image():
    return vx.data.shapes(1, seed=10_457, num_objects=2).images[0]


@pytest.fixture(scope="module")
def vit_page(tmp_path_factory, image):
    model = vx.zoo.load("shapes-vit")
    path = vx.explore(model, [image], tmp_path_factory.mktemp("vit") / "vit.html", method=["generic", "rollout"], top_k=2)
    ex = vx.Explainer(model)
    x = ex.preprocess(image)[0]
    with torch.no_grad(), vx.capture(model) as rec:
        logits = model(x)
    probs = [r.probs()[0].double().numpy() for r in rec.records]  # L x (H, N, N)
    return path, ex, x, logits, probs, rec.layout


def test_click_patch_draws_its_attention_and_rollout_rows_then_layer_head_switch(browser, vit_page) -> None:
    path, _, _, _, probs, layout = vit_page
    grid, p = layout.grid, layout.num_prefix_tokens
    rollout = _rollout(probs)
    last = len(probs) - 1
    page = Page(browser, path)
    # as loaded: last layer, head 0, query [CLS]
    assert_overlay(page.pixels("attn"), probs[last][0, 0, p:].reshape(grid))
    # the first layer's attention depends most on the query: a wrong patch would show
    page.page.select_option('select[data-vx="layer"]', "0")
    for row, col in ((grid[0] // 2, grid[1] // 3), (grid[0] - 1, 0), (1, grid[1] - 2)):
        page.click_patch("attn", grid, row, col)
        q = p + row * grid[1] + col
        assert f"query patch ({row},{col}) (pinned)" in page.page.text_content("[data-vx=query-info]")
        assert_overlay(page.pixels("attn"), probs[0][0, q, p:].reshape(grid))
        assert_overlay(page.pixels("rollout"), rollout[0][q, p:].reshape(grid))
    before = page.pixels("attn")
    page.page.select_option('select[data-vx="layer"]', "1")
    page.page.select_option('select[data-vx="head"]', "2")
    after = page.pixels("attn")
    assert_overlay(after, probs[1][2, q, p:].reshape(grid))  # the pinned query, new layer and head
    assert_overlay(page.pixels("rollout"), rollout[1][q, p:].reshape(grid))
    assert not np.array_equal(before, after)
    matrix = page.pixels("matrix")
    assert matrix.shape[:2] == (layout.num_tokens, layout.num_tokens)
    for query in (0, q):
        assert_matrix_row(matrix[query], probs[1][2, query])
    page.page.click('button[data-vx="token"][data-index="0"]')  # [CLS] as the query
    assert_overlay(page.pixels("attn"), probs[1][2, 0, p:].reshape(grid))
    assert page.close() == []


def test_method_tabs_and_class_buttons_draw_the_explainer_maps(browser, vit_page) -> None:
    path, ex, x, logits, _, _ = vit_page
    top = torch.sigmoid(logits[0]).topk(2).indices.tolist()  # shapes-vit is multi-label
    page = Page(browser, path)
    page.page.click('button[data-vx="method-tab"]:text-is("generic")')
    for i, c in enumerate(top):
        page.page.click(f'button[data-vx="class"][data-index="{i}"]')
        assert_overlay(page.pixels("method"), ex.explain(x, method="generic", target=c).maps[0].numpy())
    page.page.click('button[data-vx="method-tab"]:text-is("rollout")')
    assert_overlay(page.pixels("method"), ex.explain(x, method="rollout").maps[0].numpy())
    assert page.close() == []


def test_page_screenshot_is_not_blank(browser, vit_page) -> None:
    from PIL import Image

    page = Page(browser, vit_page[0])
    shot = np.asarray(Image.open(io.BytesIO(page.page.screenshot(full_page=True))).convert("RGB")).astype(int)
    box = page.page.locator('.vx-view:has(canvas[data-vx="attn"])').first.bounding_box()
    view = shot[int(box["y"]): int(box["y"] + box["height"]), int(box["x"]): int(box["x"] + box["width"])]
    assert shot.shape[0] >= 600 and shot.shape[1] >= 1000
    assert len(np.unique(view.reshape(-1, 3), axis=0)) > 200  # the image and its heat map, not a flat area
    assert view.std() > 20 and (np.abs(shot - shot[0, 0]).sum(-1) > 30).mean() > 0.2
    assert page.close() == []


def test_cnn_page_has_methods_and_no_attention_views(browser, tmp_path, image) -> None:
    model = vx.zoo.load("shapes-cnn")
    path = vx.explore(model, [image], tmp_path / "cnn.html", method=["gradcam", "spatial"], top_k=1)
    ex = vx.Explainer(model)
    page = Page(browser, path)
    assert page.page.locator('canvas[data-vx="attn"]').count() == 0
    assert page.page.locator('canvas[data-vx="matrix"]').count() == 0
    assert_overlay(page.pixels("method"), ex.explain([image], method="gradcam").maps[0].numpy())
    page.page.click('button[data-vx="method-tab"]:text-is("spatial")')
    assert_overlay(page.pixels("method"), ex.explain([image], method="spatial").maps[0].numpy())
    assert page.close() == []


def test_captioner_page_steps_through_words_and_alignment(browser, tmp_path, image) -> None:
    model = vx.zoo.load("shapes-captioner")
    path = vx.explore(model, [image], tmp_path / "cap.html")
    ex = vx.Explainer(model)
    cross, generic = ex.explain_caption([image], method=["cross", "cross_generic"])
    words = cross.tokens[0]
    assert len(words) >= 2
    page = Page(browser, path)
    grid = cross.maps.shape[-2:]
    drawn = []
    for t in range(len(words)):
        page.page.click(f'button[data-vx="word"][data-index="{t}"]')
        drawn.append(page.pixels("word-map"))
        assert_overlay(drawn[-1], cross.maps[0, t].numpy())
    assert not np.array_equal(drawn[0], drawn[1])
    page.page.click('button[data-vx="prev-word"]')  # back from the last word
    assert np.array_equal(page.pixels("word-map"), drawn[-2])
    align = page.pixels("align")
    assert align.shape[:2] == (len(words), grid[0] * grid[1])
    for t in range(len(words)):
        assert_matrix_row(align[t], cross.maps[0, t].flatten().numpy())
    page.page.click('button[data-vx="caption-tab"]:text-is("cross_generic")')
    page.page.click('button[data-vx="word"][data-index="1"]')
    assert_overlay(page.pixels("word-map"), generic.maps[0, 1].numpy())
    assert page.page.locator('canvas[data-vx="attn"]').count() == 1  # the image encoder's attention
    assert page.close() == []
