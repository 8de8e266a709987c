"""The explorer on every family of the support matrix (the tiny random-init builds of
``tests/support_table.py``).

Per family: the page data has the views that apply (attention views for ViTs, Hugging Face
backbones and captioners' encoders; none for CNNs and hybrids; a note where a model's attention
is class attention only), and its attention rows are the model's own: the dequantised row of the
first query in the last embedded layer equals that layer's record ``probs()`` from an independent
forward under ``vx.capture``, within the quantisation step.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import vitexplain as vx
from vitexplain.explorer.quantize import dequantize_rows

pytest.importorskip("transformers")
import support_table as support

FAMILIES = {f.name: f for f in support.rows()}
#: one cheap method per group (the support sweep covers every method)
METHOD = {"ViT": "cdam", "Hugging Face": "cdam", "Swin": "cdam", "hierarchical": "cdam", "CNN": "gradcam", "hybrid": "gradcam",
          "captioner": "cross", "VLM": "cross"}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_explore_family(name, tmp_path) -> None:
    family = FAMILIES[name]
    torch.manual_seed(0)
    if family.group == "VLM":
        _explore_vlm(family, tmp_path)
        return
    model = family.build().eval()
    support.reinit_heads(model)
    cfg = getattr(model, "pretrained_cfg", None)
    if not hasattr(model, "config"):  # timm / torchvision builds: preprocess at the tiny build's size
        model.pretrained_cfg = dict(cfg or {}, input_size=(3, *family.size))
    image = (np.random.default_rng(1).random((*family.size, 3)) * 255).astype(np.uint8)
    method = METHOD[family.group]
    given = {}
    if type(model).__name__ == "VisionEncoderDecoderModel":  # its pixel statistics come from its image processor
        import transformers

        given["processor"] = transformers.ViTImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                                            size=dict(height=family.size[0], width=family.size[1]))
    page = vx.explore(model, image, tmp_path / "p.html", method=[method], top_k=1, max_len=4, **given).read_text()
    data = json.loads(re.search(r'id="vx-data">(.*?)</script>', page, re.S).group(1))["images"][0]
    entries = data["caption"]["methods"] if data["family"] == "caption" else data["methods"]
    assert [m["name"] for m in entries] == [method]
    if callable(getattr(vx.Explainer(model).adapter, "chain", None)):  # hierarchical: each layer on its stage grid
        _check_stage_views(model, image, data)
        return
    if family.group in ("CNN", "hybrid", "Swin"):
        assert data["attention"] is None
        assert family.group != "Swin" or any("windowed attention" in note for note in data["notes"])
        return
    att = data["attention"]
    if att is None and family.group == "hierarchical":  # views per stage grid: the explorer's part of issue 23
        assert any("no attention views" in note for note in data["notes"]), data["notes"]
        return
    if att is None:  # CaiT / XCiT: every attention layer is class attention; a CNN captioner's encoder has none
        why = "no self-attention" if data["family"] == "caption" else "class attention"
        assert any(why in note for note in data["notes"]), data["notes"]
        return
    if family.target == "norm":
        assert data["targets"][0]["label"] == "norm" and any("no classifier head" in n for n in data["notes"])
    if data["family"] == "caption":
        return
    ex = vx.Explainer(model)
    x = ex.preprocess(image)[0]
    with torch.no_grad(), vx.capture(model) as rec:
        ex.adapter.forward(x)
    record = [r for r in rec.records if r.name == att["layers"][-1]][-1]
    exact = record.probs()[0, 0, 0].numpy()  # head 0, query 0
    p, n = att["prefix"], exact.shape[0]
    rows = dequantize_rows(att["probs"]["patches"]).reshape(len(att["layerIndex"]), len(att["heads"]), n, n - p)
    assert np.abs(rows[-1, 0, 0] - exact[p:]).max() <= exact[p:].max() / 510 * 1.001


def _check_stage_views(model, image, data) -> None:
    """A hierarchical model's views: per layer its own query and key sets; the last layer's rows
    are its record's (a global call: the same values as the record's head 0, or head mean, within
    the quantisation step, compared sorted since a model may order its tokens otherwise than the
    grid, e.g. Hiera's unrolled order; a windowed call, placed by its slots: every query's row
    holds at most one window's keys); no row sums past 1."""
    att = data["attention"]
    assert att is not None and att["probs"] is not None, data["notes"]
    assert len(att["sets"]) == len(att["layers"]) == len(att["probs"]) == len(att["rollout"])
    ex = vx.Explainer(model)
    x = ex.preprocess(image)[0]
    with torch.no_grad(), vx.capture(model) as rec:
        ex.adapter.forward(x)
    record = [r for r in rec.records if r.name == att["layers"][-1]][-1]
    q, k = att["sets"][-1]["q"], att["sets"][-1]["k"]
    nq, nk = q[0] + q[1] * q[2], k[0] + k[1] * k[2]
    heads = att["heads"][-1]
    patches = dequantize_rows(att["probs"][-1]["patches"]).reshape(len(heads), nq, nk - k[0])
    prefix = (dequantize_rows(att["probs"][-1]["prefix"]).reshape(len(heads), nq, k[0]) if k[0]
              else np.zeros((len(heads), nq, 0)))
    rows = np.concatenate([prefix, patches], axis=-1)
    if (record.batch_size, record.num_queries, record.num_keys) == (1, nq, nk):
        probs = record.probs()[0]
        exact = (probs.mean(0) if heads == ["mean"] else probs[0]).numpy()
        got = np.sort(rows[0].ravel())
        assert np.abs(got - np.sort(exact.ravel())).max() <= exact.max() / 255 * 1.001
    else:
        assert (rows > 0).sum(-1).max() <= record.num_keys
    sums = rows.sum(-1)
    assert sums.max() <= 1.02 and sums.max() > 0


def _explore_vlm(family, tmp_path) -> None:
    """A vision-language row: the page steps through the answer's words with the method's maps over
    the image and the language model's attention."""
    image = (np.random.default_rng(1).random((*family.size, 3)) * 255).astype(np.uint8)
    model, processor = family.build()
    model.eval()  # the VLM builders re-initialise their zero projectors and gates themselves
    page = vx.explore(model, image, tmp_path / "p.html", processor=processor, method=["cross"], max_len=3).read_text()
    data = json.loads(re.search(r'id="vx-data">(.*?)</script>', page, re.S).group(1))["images"][0]
    assert data["family"] == "vlm"
    vlm = data["vlm"]
    assert [m["name"] for m in vlm["methods"]] == ["cross"]  # a random model may answer with no word at all
    assert vlm["pieces"], "the page draws each token grid over its box of the image"
