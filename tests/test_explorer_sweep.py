"""Regressions found by a sweep of the explorer page over the zoo, timm ViT variants, hierarchical
models, CNNs and Hugging Face backbones, in headless chromium.

CrossViT: its adapter runs the chain on one joint token set ``[cls_0, patches_0, cls_1, patches_1]``
(a flat 1 x N "grid"), which the page drew as a 1 x 42 strip stretched over the image: hovering the
image's right edge picked a token of the other branch, and every key was drawn at a place of the image
that is not its patch. The page now draws each branch's calls on that branch's grid (its class token the
prefix) and a fusion call's keys (the class token and the other branch's patches) on the other branch's
grid. The oracle is each call's own record (``probs()`` of an independent forward under ``vx.capture``):
a branch call attends inside its branch, tokens in the model's order ``[cls, patches row-major]``.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import vitexplain as vx
from vitexplain.explorer.quantize import dequantize_rows
from test_explorer_browser import Page, assert_overlay, browser  # noqa: F401  (fixture)


def _crossvit() -> torch.nn.Module:
    from timm.models.crossvit import CrossVit

    torch.manual_seed(0)
    model = CrossVit(img_size=48, img_scale=(1.0, 32 / 48), patch_size=(8, 16), embed_dim=(16, 32),
                     depth=((1, 2, 0), (1, 1, 0)), num_heads=(2, 2), mlp_ratio=(2, 2, 1), num_classes=5).eval()
    model.pretrained_cfg = dict(getattr(model, "pretrained_cfg", None) or {}, input_size=(3, 48, 48))
    return model


def _page_and_records(model, image, folder):
    """The explorer page of ``image`` (rollout), its first image's embedded data, and the records of the same
    forward captured by the API."""
    path = vx.explore(model, image, folder / "p.html", method=["rollout"], top_k=1)
    data = json.loads(re.search(r'id="vx-data">(.*?)</script>', path.read_text(), re.S).group(1))["images"][0]
    ex = vx.Explainer(model)
    with torch.no_grad(), vx.capture(model) as rec:
        ex.adapter.forward(ex.preprocess(image)[0])
    return path, data, rec.records


@pytest.fixture(scope="module")
def crossvit_page(tmp_path_factory):
    model = _crossvit()
    image = (np.random.default_rng(3).random((48, 48, 3)) * 255).astype(np.uint8)
    path, data, recorded = _page_and_records(model, image, tmp_path_factory.mktemp("crossvit"))
    records = {r.name: r.probs()[0].numpy() for r in recorded}  # the last call of each module
    return path, data["attention"], records


def _rows(part: dict, heads: int, nq: int) -> np.ndarray:
    """(heads, nq, n_k) of a layer's stored rows (prefix and patch keys joined)."""
    rows = dequantize_rows(part["patches"])
    if part["prefix"] is not None:
        rows = np.concatenate([dequantize_rows(part["prefix"]), rows], axis=1)
    return rows.reshape(heads, nq, -1)


def test_crossvit_layers_are_on_their_branch_grids_with_their_records_attention(crossvit_page) -> None:
    _, att, records = crossvit_page
    branch = {0: [1, 6, 6], 1: [1, 2, 2]}  # 48 px / 8 px patches; 32 px / 16 px patches; one class token each
    assert att["grid"] == [6, 6] and att["prefix"] == 1 and att["tokens"] == ["[CLS]"]
    for l, name in enumerate(att["layers"]):
        b = int(name.split(".")[3])  # blocks.i.blocks.b.j.attn / blocks.i.fusion.b.attn
        fusion = ".fusion." in name
        assert att["sets"][l]["q"] == branch[b], name
        assert att["sets"][l]["k"] == branch[1 - b if fusion else b], name
        q, k = att["sets"][l]["q"], att["sets"][l]["k"]
        nq, nk = q[0] + q[1] * q[2], k[0] + k[1] * k[2]
        rows = _rows(att["probs"][l], len(att["heads"][l]), nq)
        exact = records[name]  # (H, n_q, n_k): a branch call on its tokens, a fusion call from its class token
        assert rows.shape[-1] == nk == exact.shape[-1], name
        tol = exact.max() / 255 * 1.001  # each row part quantised to 8 bits of its own largest value
        if fusion:
            assert np.abs(rows[:, :1] - exact).max() <= tol, name
            assert np.all(rows[:, 1:] == 0), name  # only the class token is queried
        else:
            assert np.abs(rows - exact).max() <= tol, name
        assert _rows(att["rollout"][l], 1, nq).shape == (1, nq, 37), name  # onto branch 0's input tokens
    # the first call (branch 0's first block) rolls out to 0.5 mean_h(A) + 0.5 I over branch 0's tokens
    first = records[att["layers"][0]]
    assert att["layers"][0] == "blocks.0.blocks.0.0.attn"
    expected = 0.5 * first.mean(0) + 0.5 * np.eye(37)
    roll = _rows(att["rollout"][0], 1, 37)[0]
    assert np.abs(roll - expected).max() <= expected.max() / 255 * 1.001


def test_crossvit_page_draws_a_branch_patchs_attention_on_its_branch_grid(browser, crossvit_page) -> None:
    path, att, records = crossvit_page
    page = Page(browser, path)
    layer = att["layers"].index("blocks.0.blocks.1.0.attn")  # branch 1: 2 x 2 patches of 16 px
    page.page.select_option('select[data-vx="layer"]', str(layer))
    page.click_patch("attn", (2, 2), 1, 0)  # the bottom-left patch of the image
    exact = records["blocks.0.blocks.1.0.attn"][0]  # head 0, (5, 5): [cls, (0,0), (0,1), (1,0), (1,1)]
    assert_overlay(page.pixels("attn"), exact[1 + 2, 1:].reshape(2, 2))
    assert page.close() == []


# -- a prefix token that joins at a later stage (HF PVT v1: the class token, on the last stage) ---------------

@pytest.fixture(scope="module")
def pvt_v1_page(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.PvtConfig(image_size=64, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1],
                                    num_attention_heads=[1, 2, 2, 4], num_labels=5)
    model = transformers.PvtForImageClassification(config).eval()
    image = (np.random.default_rng(4).random((64, 64, 3)) * 255).astype(np.uint8)
    path, data, recorded = _page_and_records(model, image, tmp_path_factory.mktemp("pvt1"))
    att = data["attention"]
    last = [r for r in recorded if r.name == att["layers"][-1]][-1].probs()[0].numpy()
    return path, att, last


def test_pvt_v1_class_token_of_the_last_stage_is_labelled(pvt_v1_page) -> None:
    _, att, last = pvt_v1_page
    assert att["prefix"] == 0 and att["sets"][0]["q"][0] == 0  # the first stage has no class token
    assert att["sets"][-1]["q"] == [1, 2, 2] and last.shape[-1] == 5
    assert att["tokens"] == ["[CLS]"]  # was [] and the page wrote "query undefined"


def test_pvt_v1_class_token_can_be_picked_on_the_last_stage_only(browser, pvt_v1_page) -> None:
    path, att, last = pvt_v1_page
    page = Page(browser, path)
    cls = page.page.locator('button[data-vx="token"][data-index="0"]')
    page.page.select_option('select[data-vx="layer"]', "0")
    assert cls.is_disabled()  # stage 0's queries have no class token
    page.page.select_option('select[data-vx="layer"]', str(len(att["layers"]) - 1))
    cls.click()
    assert_overlay(page.pixels("attn"), last[0, 0, 1:].reshape(2, 2))  # head 0, the class token's row
    info = page.page.locator('[data-vx="query-info"]').text_content()
    assert info.startswith("query [CLS] (pinned)"), info
    box = page.page.locator('canvas[data-vx="matrix"]').bounding_box()
    page.page.mouse.move(box["x"] + 1, box["y"] + 1)  # the matrix cell ([CLS], [CLS])
    text = page.page.locator('figure:has(canvas[data-vx="matrix"]) p.vx-info').text_content()
    assert text.startswith("query [CLS] \u2192 key [CLS]:"), text
    assert page.close() == []


# -- Hugging Face DeiT's distillation token (on its embeddings, not the model) -------------------------------

@pytest.mark.parametrize("cls_name", ["DeiTForImageClassification", "DeiTForImageClassificationWithTeacher"])
def test_hf_deit_distillation_token_is_labelled_dist(tmp_path, cls_name) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DeiTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, num_labels=5)
    model = getattr(transformers, cls_name)(config).eval()
    image = (np.random.default_rng(5).random((32, 32, 3)) * 255).astype(np.uint8)
    path = vx.explore(model, image, tmp_path / "p.html", method=["raw"], top_k=1)
    att = json.loads(re.search(r'id="vx-data">(.*?)</script>', path.read_text(), re.S).group(1))["images"][0]["attention"]
    assert att["tokens"] == ["[CLS]", "[DIST]"]  # the second was "[REG0]"
    # the model's own order: token 1 of the embeddings is the distillation token (plus its position embedding)
    emb = model.deit.embeddings
    with torch.no_grad():
        tokens = emb(torch.zeros(1, 3, 32, 32))
    assert torch.allclose(tokens[0, 1], (emb.distillation_token + emb.position_embeddings[:, 1])[0], atol=1e-6)


# -- a small attention budget is written as given -------------------------------------------------------------

@pytest.mark.parametrize("model_name", ["shapes-vit", "shapes-hier"])
def test_a_small_attention_budget_is_written_as_given_not_as_zero(tmp_path, model_name) -> None:
    image = vx.data.shapes(1, seed=2).images[0]
    path = vx.explore(vx.zoo.load(model_name), image, tmp_path / "p.html", method=["rollout"], top_k=1,
                      attention_budget=0.002)
    att = json.loads(re.search(r'id="vx-data">(.*?)</script>', path.read_text(), re.S).group(1))["images"][0]["attention"]
    assert att["probs"] is None and "page budget (0.002 MB)" in att["note"], att["note"]  # was "(0.0 MB)"


# -- a captioner that ends its caption at once ----------------------------------------------------------------

def test_a_caption_with_no_word_says_so_instead_of_drawing_word_1_of_0(tmp_path) -> None:
    model = vx.zoo.load("shapes-captioner")
    with torch.no_grad():
        model.head.bias[model.vocab.eos_id] += 1000.0  # the end token always wins: no word is generated
    image = vx.data.shapes(1, seed=1).images[0]
    assert vx.Explainer(model).explain_caption(vx.Explainer(model).preprocess(image)[0], method="cross").tokens == [[]]
    path = vx.explore(model, image, tmp_path / "p.html", method=["cross"])
    data = json.loads(re.search(r'id="vx-data">(.*?)</script>', path.read_text(), re.S).group(1))["images"][0]
    assert data["caption"] == {"words": [], "methods": []}  # was one all-zero row shown as "word 1 of 0"
    assert any("ended its caption at once" in note for note in data["notes"]), data["notes"]
    assert data["attention"] is not None and data["attention"]["probs"] is not None  # the encoder's views stay
