"""The explorer's attention views of a hierarchical model: every layer on its own stage grid.

A small timm PVTv2 (the architecture of ``shapes-hier --arch pvt``, random weights, 64 px: stages on 16 x 16,
8 x 8 and 4 x 4 grids; the first stage's keys pooled 2 x 2) is explored. The oracle is written
out here from the model's own modules: the grids from its convs' kernel, stride and padding, the
attention from ``vx.capture`` records, and the rollout with the footprints of the strided convs
as dense matrices (each coarse token the mean of the fine tokens its kernel covers), independent
of ``vitexplain.methods.resample``. The browser test reads the drawn canvases back.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import vitexplain as vx
from vitexplain.explorer.quantize import dequantize_rows
from vitexplain.zoo.models import PVT_CONFIG, build, pretrained_cfg

pytest.importorskip("vitexplain.methods.resample", reason="needs the hierarchical family (issue 23, branch hier)")


def _pvt() -> torch.nn.Module:
    """The PVTv2 of shapes-hier --arch pvt with random weights and the zoo's preprocessing (64 px)."""
    torch.manual_seed(0)
    config = PVT_CONFIG
    model = build(config).eval()
    model.pretrained_cfg = pretrained_cfg(config)
    return model


def _out(n: int, k: int, s: int, p: int) -> int:
    return (n + 2 * p - k) // s + 1


def _footprint(fine: tuple[int, int], kernel: int, stride: int, pad: int) -> np.ndarray:
    """(coarse, fine) matrix: each coarse token the mean of the real fine tokens under its kernel."""
    coarse = (_out(fine[0], kernel, stride, pad), _out(fine[1], kernel, stride, pad))
    m = np.zeros((coarse[0] * coarse[1], fine[0] * fine[1]))
    for i in range(coarse[0]):
        for j in range(coarse[1]):
            cells = [a * fine[1] + b for a in range(i * stride - pad, i * stride - pad + kernel)
                     for b in range(j * stride - pad, j * stride - pad + kernel)
                     if 0 <= a < fine[0] and 0 <= b < fine[1]]
            m[i * coarse[1] + j, cells] = 1.0 / len(cells)
    return m


def _oracle(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[tuple], list[np.ndarray], list[np.ndarray]]:
    """Per attention call: (query grid, key grid), head probabilities (H, n_q, n_k), rollout (n_q, n_0)."""
    with torch.no_grad(), vx.capture(model) as rec:
        model(x)
    probs = [r.probs()[0].double().numpy() for r in rec.records]
    conv = model.patch_embed.proj
    grid = (_out(x.shape[-2], conv.kernel_size[0], conv.stride[0], conv.padding[0]),
            _out(x.shape[-1], conv.kernel_size[1], conv.stride[1], conv.padding[1]))
    geometry, rolls, r, k = [], [], np.eye(grid[0] * grid[1]), 0
    for s, stage in enumerate(model.stages):
        if s > 0:
            c = stage.downsample.proj
            d = _footprint(grid, c.kernel_size[0], c.stride[0], c.padding[0])
            r = d @ r
            grid = (_out(grid[0], c.kernel_size[0], c.stride[0], c.padding[0]),
                    _out(grid[1], c.kernel_size[1], c.stride[1], c.padding[1]))
        for block in stage.blocks:
            sr = block.attn.sr
            dk = np.eye(grid[0] * grid[1]) if sr is None else _footprint(grid, sr.kernel_size[0], sr.stride[0], 0)
            keys = grid if sr is None else (grid[0] // sr.stride[0], grid[1] // sr.stride[1])
            hat = 0.5 * probs[k].mean(0) @ dk + 0.5 * np.eye(grid[0] * grid[1])
            r = (hat / hat.sum(-1, keepdims=True)) @ r
            geometry.append((grid, keys))
            rolls.append(r)
            k += 1
    return geometry, probs, rolls


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    model = _pvt()
    image = vx.data.shapes(1, seed=10_457, num_objects=2).images[0]
    path = vx.explore(model, [image], tmp_path_factory.mktemp("hier") / "hier.html", method=["rollout"], top_k=1)
    ex = vx.Explainer(model)
    x = ex.preprocess(image)[0]
    return path, model, ex, x


def _payload(html: str) -> dict:
    match = re.search(r'<script type="application/json" id="vx-data">(.*?)</script>', html, re.S)
    return json.loads(match.group(1))


def test_each_layer_is_on_its_own_stage_grid_with_its_attention_and_rollout(page) -> None:
    path, model, _, x = page
    att = _payload(path.read_text())["images"][0]["attention"]
    geometry, probs, rolls = _oracle(model, x)
    assert [tuple(s["q"][1:]) for s in att["sets"]] == [g[0] for g in geometry] == [(16, 16), (8, 8), (4, 4), (4, 4)]
    assert [tuple(s["k"][1:]) for s in att["sets"]] == [g[1] for g in geometry] == [(8, 8), (8, 8), (4, 4), (4, 4)]
    assert [s["stage"] for s in att["sets"]] == [0, 1, 2, 2]
    assert att["grid"] == [16, 16] and att["prefix"] == 0
    assert [len(h) for h in att["heads"]] == [1, 2, 4, 4]  # the heads of each stage
    for layer, (p, r) in enumerate(zip(probs, rolls)):
        got = dequantize_rows(att["probs"][layer]["patches"]).reshape(p.shape)
        step = p.max(-1, keepdims=True) / 255  # one quantisation step of each row
        assert np.all(np.abs(got - p) <= step + 1e-7), layer
        got_r = dequantize_rows(att["rollout"][layer]["patches"]).reshape(r.shape)
        assert np.all(np.abs(got_r - r) <= r.max(-1, keepdims=True) / 255 + 1e-6), layer


def test_the_last_rollout_read_out_is_the_rollout_method_map(page) -> None:
    path, _, ex, x = page
    att = _payload(path.read_text())["images"][0]["attention"]
    last = dequantize_rows(att["rollout"][-1]["patches"]).mean(0).reshape(16, 16)
    want = ex.explain(x, method="rollout").maps[0].double().numpy()
    np.testing.assert_allclose(last / last.sum(), want / want.sum(), atol=2e-4)


def test_a_small_budget_fuses_heads_then_keeps_the_last_layer() -> None:
    from vitexplain.explorer.stages import stage_payload

    model = _pvt()
    x = torch.randn(1, 3, 64, 64)
    adapter = vx.Explainer(model).adapter
    with torch.no_grad(), vx.capture(model) as rec:
        model(x)
    full = stage_payload(adapter, rec.records, (64, 64), [], budget=10**7)
    assert full["note"] == "" and len(full["layerIndex"]) == 4
    small = stage_payload(adapter, rec.records, (64, 64), [], budget=30_000)
    assert all(h == ["mean"] for h in small["heads"]) and "heads fused" in small["note"]
    assert 0 < len(small["layerIndex"]) < 4 and small["layerIndex"][-1] == 3
    none = stage_payload(adapter, rec.records, (64, 64), [], budget=10)
    assert none["probs"] is None and "does not fit" in none["note"]


def test_browser_draws_each_layer_on_its_grid_and_keeps_the_query_across_grids(page) -> None:
    from test_explorer_browser import Page, _chromium, _playwright, assert_overlay

    path, model, _, x = page
    geometry, probs, rolls = _oracle(model, x)
    sync_playwright = _playwright()
    executable = _chromium()
    import test_explorer_browser as tb

    with sync_playwright() as pw:
        context = pw.chromium.launch(executable_path=executable, headless=True, args=tb.FLAGS).new_context(
            viewport={"width": 1300, "height": 1000})
        view = Page(context, path)
        # as loaded: the last layer (4 x 4 queries and keys), head 0, query patch (0, 0)
        assert view.pixels("attn").shape[:2] == (4, 4)
        assert_overlay(view.pixels("attn"), probs[3][0, 0].reshape(4, 4))
        view.page.select_option('select[data-vx="layer"]', "0")  # 16 x 16 queries, keys pooled to 8 x 8
        row, col = 5, 9
        view.click_patch("attn", (16, 16), row, col)
        q = row * 16 + col
        info = view.page.text_content("[data-vx=query-info]")
        assert f"query patch ({row},{col}) (pinned)" in info and "queries on a 16\u00d716 grid, keys on 8\u00d78" in info
        assert_overlay(view.pixels("attn"), probs[0][0, q].reshape(8, 8))
        assert_overlay(view.pixels("rollout"), rolls[0][q].reshape(16, 16))
        assert view.pixels("matrix").shape[:2] == (256, 64)
        # the same point on the last stage's 4 x 4 grid: patch (1, 2); head 3 exists there only
        view.page.select_option('select[data-vx="layer"]', "3")
        view.page.select_option('select[data-vx="head"]', "3")
        q = 1 * 4 + 2
        assert "query patch (1,2) (pinned)" in view.page.text_content("[data-vx=query-info]")
        assert_overlay(view.pixels("attn"), probs[3][3, q].reshape(4, 4))
        assert_overlay(view.pixels("rollout"), rolls[3][q].reshape(16, 16))
        view.page.select_option('select[data-vx="layer"]', "1")  # 2 heads: head 3 falls back to their mean
        assert view.page.input_value('select[data-vx="head"]') == "mean"
        assert_overlay(view.pixels("attn"), probs[1][:, 2 * 8 + 4].mean(0).reshape(8, 8))
        assert view.close() == []
        context.close()
