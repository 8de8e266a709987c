"""The explorer's Python side: quantisation, attention data, rollout, the page file.

The browser half (drawn pixels, clicks) is tests/test_explorer_browser.py.
"""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest
import timm
import torch

import vitexplain as vx
from vitexplain.explorer.attention import attention_payload, prefix_labels, rollout_matrices
from vitexplain.explorer.page import external_references
from vitexplain.explorer.quantize import dequantize_rows, payload_bytes, quantize_rows


@pytest.fixture(scope="module")
def shapes_vit():
    return vx.zoo.load("shapes-vit")


@pytest.fixture(scope="module")
def images():
    return list(vx.data.shapes(2, seed=10_321).images)


def _reg_vit() -> torch.nn.Module:
    """A small timm ViT with a class token and two register tokens (random weights)."""
    torch.manual_seed(1)
    model = timm.create_model(
        "vit_small_patch16_224", pretrained=False, img_size=48, patch_size=16, depth=3,
        num_heads=2, embed_dim=32, reg_tokens=2, num_classes=4,
    ).eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)
    return model


def _payload(page: str) -> dict:
    block = re.search(r'<script type="application/json" id="vx-data">(.*?)</script>', page, re.S)
    return json.loads(block.group(1))


# -- quantisation -------------------------------------------------------------------------------

def test_quantize_rows_error_is_within_half_a_step_of_each_rows_scale() -> None:
    rng = np.random.default_rng(0)
    rows = rng.gamma(0.3, size=(7, 50)) * rng.uniform(1e-4, 10, size=(7, 1))
    rows[3] = 0.0
    q = quantize_rows(rows)
    back = dequantize_rows(q)
    scale = rows.max(axis=1, keepdims=True)
    assert not q["signed"] and q["rows"] == 7 and q["cols"] == 50
    assert np.all(np.abs(back - rows) <= scale / 510 * (1 + 1e-5) + 1e-12)
    codes = np.frombuffer(base64.b64decode(q["data"]), np.uint8).reshape(7, 50)
    assert np.all(codes[np.arange(7) != 3].max(axis=1) == 255)  # each row's max is code 255
    assert np.all(back[3] == 0)
    assert len(q["data"]) + len(q["scale"]) == payload_bytes(7, 50)


def test_quantize_rows_signed_keeps_zero_exact_and_symmetric_scale() -> None:
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(5, 40))
    rows[:, :4] = 0.0
    q = quantize_rows(rows, signed=True)
    back = dequantize_rows(q)
    scale = np.abs(rows).max(axis=1, keepdims=True)
    assert q["signed"]
    assert np.all(back[:, :4] == 0)
    assert np.all(np.abs(back - rows) <= scale / 254 * (1 + 1e-5))
    # a negative value in a non-negative request switches to signed codes (no clipping)
    assert quantize_rows(np.array([[0.5, -0.1]]))["signed"]


def test_quantize_rows_rejects_nan() -> None:
    with pytest.raises(vx.UsageError, match="NaN"):
        quantize_rows(np.array([[1.0, np.nan]]))


# -- attention data -----------------------------------------------------------------------------

def test_rollout_matrices_class_row_is_the_rollout_method(shapes_vit, images) -> None:
    """Row [CLS] of the last cumulative rollout equals vx's rollout map (a vector propagation)."""
    ex = vx.Explainer(shapes_vit)
    x = ex.preprocess(images)[0]
    expected = ex.explain(x, method="rollout").maps
    with vx.capture(shapes_vit) as rec:
        shapes_vit(x)
    layout = rec.layout
    for b in range(x.shape[0]):
        r = rollout_matrices([record.probs()[b].mean(dim=0) for record in rec.records])
        got = layout.to_grid(r[-1][0])
        torch.testing.assert_close(got, expected[b], rtol=1e-4, atol=1e-6)
        assert torch.allclose(r[0].sum(dim=-1), torch.ones(layout.num_tokens), atol=1e-5)  # row-stochastic


def test_attention_payload_holds_every_layer_and_head_within_quantisation() -> None:
    model = _reg_vit()
    x = torch.randn(1, 3, 48, 48)
    with vx.capture(model) as rec:
        model(x)
    layout = rec.layout
    labels = prefix_labels(model, layout)
    assert labels == ["[CLS]", "[REG0]", "[REG1]"]
    data = attention_payload(rec.records, layout, labels)
    n, p = layout.num_tokens, layout.num_prefix_tokens
    assert data["layerIndex"] == [0, 1, 2] and data["heads"] == ["0", "1"] and data["note"] == ""
    patches = dequantize_rows(data["probs"]["patches"]).reshape(3, 2, n, n - p)
    prefix = dequantize_rows(data["probs"]["prefix"]).reshape(3, 2, n, p)
    for layer, record in enumerate(rec.records):
        exact = record.probs()[0].numpy()  # (H, N, N)
        step_patch = exact[..., p:].max(axis=-1, keepdims=True) / 510
        step_prefix = exact[..., :p].max(axis=-1, keepdims=True) / 510
        assert np.all(np.abs(patches[layer] - exact[..., p:]) <= step_patch * 1.001 + 1e-9)
        assert np.all(np.abs(prefix[layer] - exact[..., :p]) <= step_prefix * 1.001 + 1e-9)


def test_attention_payload_degrades_to_fewer_layers_then_head_mean_within_budget() -> None:
    model = _reg_vit()
    with vx.capture(model) as rec:
        model(torch.randn(1, 3, 48, 48))
    layout, labels = rec.layout, ["[CLS]", "[REG0]", "[REG1]"]
    n, p = layout.num_tokens, layout.num_prefix_tokens
    one = payload_bytes(n, p) + payload_bytes(n, n - p)  # one (N, N) matrix, split in two parts
    full = attention_payload(rec.records, layout, labels, budget=3 * 3 * one)
    assert full["layerIndex"] == [0, 1, 2]
    two = attention_payload(rec.records, layout, labels, budget=2 * 3 * one)  # 2 layers x (2 heads + rollout)
    assert two["layerIndex"] == [0, 2] and "2 of 3 layers" in two["note"]
    mean = attention_payload(rec.records, layout, labels, budget=2 * one)
    assert mean["heads"] == ["mean"] and mean["layerIndex"] == [2] and "heads fused" in mean["note"]
    fused = np.stack([r.probs()[0].mean(dim=0).numpy() for r in rec.records])
    got = dequantize_rows(mean["probs"]["patches"]).reshape(n, n - p)
    assert np.abs(got - fused[2][:, p:]).max() <= fused[2][:, p:].max() / 510 * 1.001
    none = attention_payload(rec.records, layout, labels, budget=one)
    assert none["probs"] is None and "does not fit" in none["note"]
    for data in (full, two, mean):  # the embedded sizes respect the budget
        size = sum(len(q["data"]) + len(q["scale"]) for part in ("probs", "rollout") for q in data[part].values() if q)
        assert size <= {id(full): 9, id(two): 6, id(mean): 2}[id(data)] * one


# -- the page -----------------------------------------------------------------------------------

class _Attrs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]


def test_external_references_finds_links_out_of_the_file() -> None:
    page = (
        '<html><head><link rel="stylesheet" href="https://cdn.example/x.css">'
        "<style>@import 'http://a/b.css'; .a{background:url(//c/d.png)} .b{background:url(data:image/png;base64,AA)}</style>"
        '</head><body><img src="data:image/png;base64,AA"><a href="#top">x</a><script src="x.js"></script></body></html>'
    )
    found = external_references(page)
    assert len(found) == 4, found
    assert external_references('<img src="data:image/png;base64,AA"><a href="#a">a</a>') == []


def test_explore_writes_one_self_contained_page(shapes_vit, images, tmp_path) -> None:
    out = vx.explore(shapes_vit, images, tmp_path / "sub" / "page.html", top_k=2, names=["a</script>", "b"])
    page = out.read_text()
    parser = _Attrs()
    parser.feed(page)
    assert all(r.startswith(("data:", "#")) for r in parser.refs)
    assert external_references(page) == []
    assert re.search(r"(?i)\b(https?|ftp|wss?)://", page) is None  # no URL anywhere
    assert "default-src 'none'" in page  # the browser itself refuses any request
    assert page.count("</script>") == 2  # a name cannot close the data block
    data = _payload(page)
    assert [d["name"] for d in data["images"]] == ["a</script>", "b"]
    first = data["images"][0]
    assert all(d["image"].startswith("data:image/png;base64,") for d in data["images"])
    assert [m["name"] for m in first["methods"]] == list(vx.methods.VIT.defaults) == ["generic", "legrad"]
    assert [m["maps"]["rows"] for m in first["methods"]] == [2, 2]  # top-2 classes
    assert len(first["predictions"]) == 2 and first["attention"]["layerIndex"] == [0, 1, 2, 3]
    assert out.stat().st_size <= 1_000_000  # the budget: one shapes image <= 1 MB


def test_explore_returns_a_path_that_jupyter_shows_inline(shapes_vit, images, tmp_path) -> None:
    import html
    from pathlib import Path

    out = vx.explore(shapes_vit, images[:1], tmp_path / "inline.html", top_k=1)
    assert isinstance(out, Path) and out == tmp_path / "inline.html"  # still the path it always was
    frame = out._repr_html_()
    assert frame.startswith("<iframe") and frame.endswith("</iframe>")
    assert 'sandbox="allow-scripts"' in frame  # scripts run; no same-origin access to the notebook
    srcdoc = re.search(r'srcdoc="([^"]*)"', frame).group(1)  # one attribute: no raw quote escaped it
    assert html.unescape(srcdoc) == out.read_text(encoding="utf-8")
    assert "<" not in srcdoc and external_references(frame) == []


def test_explore_page_of_vit_small_224_fits_six_megabytes(tmp_path) -> None:
    """Budget: one 224 px vit_small image <= 6 MB (every layer and head embedded)."""
    model = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=10).eval()
    image = (np.random.default_rng(2).random((224, 224, 3)) * 255).astype(np.uint8)
    out = vx.explore(model, image, tmp_path / "p.html", method=["rollout"], top_k=1)
    data = _payload(out.read_text())["images"][0]["attention"]
    assert data["layerIndex"] == list(range(12)) and data["heads"] == [str(h) for h in range(6)]
    assert out.stat().st_size <= 6_000_000


def test_explore_cnn_has_methods_and_no_attention(images, tmp_path) -> None:
    model = vx.zoo.load("shapes-cnn")
    data = _payload(vx.explore(model, images[:1], tmp_path / "c.html").read_text())["images"][0]
    assert data["attention"] is None and data["family"] == "cnn"
    assert [m["name"] for m in data["methods"]] == ["gradcam", "spatial", "channel"]


def test_explore_default_methods_that_do_not_apply_are_noted_named_ones_raise(tmp_path) -> None:
    model = timm.create_model("resnet10t", pretrained=False, num_classes=3).eval()  # no attention gates
    model.pretrained_cfg = dict(model.pretrained_cfg, input_size=(3, 64, 64))  # small input: fast
    image = np.zeros((40, 40, 3), np.uint8)
    data = _payload(vx.explore(model, image, tmp_path / "r.html", top_k=1).read_text())["images"][0]
    names = [m["name"] for m in data["methods"]]
    assert "gradcam" in names and "spatial" not in names
    assert any(note.startswith("spatial left out") for note in data["notes"])
    with pytest.raises(vx.VitexplainError):
        vx.explore(model, image, tmp_path / "r2.html", method=["gradcam", "spatial"])
    assert not (tmp_path / "r2.html").exists()


def test_explore_bad_arguments(shapes_vit, images, tmp_path) -> None:
    with pytest.raises(vx.UsageError, match="no images"):
        vx.explore(shapes_vit, [], tmp_path / "x.html")
    with pytest.raises(vx.UsageError, match="top_k"):
        vx.explore(shapes_vit, images, tmp_path / "x.html", top_k=0)
    with pytest.raises(vx.UsageError, match="names"):
        vx.explore(shapes_vit, images, tmp_path / "x.html", names=["one"])
    with pytest.raises(vx.UnsupportedMethodError):
        vx.explore(shapes_vit, images, tmp_path / "x.html", method=["cross"])


def test_explore_captioner_words_maps_and_encoder_attention(images, tmp_path) -> None:
    model = vx.zoo.load("shapes-captioner")
    data = _payload(vx.explore(model, images[:1], tmp_path / "k.html").read_text())["images"][0]
    ex = vx.Explainer(model)
    expected = ex.explain_caption(images[:1], method="cross")
    words = expected.tokens[0]
    assert data["caption"]["words"] == words and data["predictions"][0]["label"] == " ".join(words)
    cross = data["caption"]["methods"][0]
    assert cross["name"] == "cross" and [m["name"] for m in data["caption"]["methods"]] == ["cross", "cross_generic"]
    got = dequantize_rows(cross["maps"])
    exact = expected.maps[0, : len(words)].flatten(1).numpy()
    assert np.abs(got - exact).max() <= exact.max() / 510 * 1.001
    assert data["attention"]["tokens"] == ["[CLS]"] and len(data["attention"]["layerIndex"]) == 4


def test_explore_show_attend_tell_words_without_encoder_attention(images, tmp_path) -> None:
    """shapes-sat: its own additive attention per word; a CNN encoder has no attention views, and says so."""
    model = vx.zoo.load("shapes-sat")
    data = _payload(vx.explore(model, images[:1], tmp_path / "s.html").read_text())["images"][0]
    expected = vx.Explainer(model).explain_caption(images[:1], method="cross")
    words = expected.tokens[0]
    assert data["caption"]["words"] == words
    got = dequantize_rows(data["caption"]["methods"][0]["maps"])
    exact = expected.maps[0, : len(words)].flatten(1).numpy()
    assert np.abs(got - exact).max() <= exact.max() / 510 * 1.001
    assert data["attention"] is None and any("no self-attention" in n for n in data["notes"])


def test_explore_one_given_target(shapes_vit, images, tmp_path) -> None:
    data = _payload(vx.explore(shapes_vit, images[:1], tmp_path / "t.html", method=["generic"], target="star").read_text())
    first = data["images"][0]
    assert first["targets"] == [{"index": 3, "label": "star", "score": None}]  # the class given, by its label
    assert first["methods"][0]["maps"]["rows"] == 1
    expected = vx.Explainer(shapes_vit).explain(images[:1], method="generic", target="star").maps[0].flatten().numpy()
    got = dequantize_rows(first["methods"][0]["maps"])[0]
    assert np.abs(got - expected).max() <= expected.max() / 510 * 1.001


@pytest.mark.parametrize("target, message", [("hexagon", "unknown label 'hexagon'"), (99, "out of range")])
def test_explore_a_bad_target_raises_instead_of_leaving_every_default_method_out(shapes_vit, images, tmp_path,
                                                                                 target, message) -> None:
    # with the default methods a failing method is left out with a note; a bad target fails them all,
    # which would give a page with no maps at all: the caller's mistake must raise instead
    with pytest.raises(vx.errors.TargetError, match=message):
        vx.explore(shapes_vit, images[:1], tmp_path / "t.html", target=target)
    assert not (tmp_path / "t.html").exists()


def test_explore_out_naming_a_folder_is_a_usage_error_before_any_work(shapes_vit, images, tmp_path) -> None:
    with pytest.raises(vx.errors.UsageError, match="is a folder"):
        vx.explore(shapes_vit, images[:1], tmp_path)
    assert list(tmp_path.iterdir()) == []  # no page, no temporary file


@pytest.mark.parametrize("name", ["shapes-captioner", "shapes-vlm"])
def test_explore_refuses_a_class_target_for_a_model_that_explains_its_words(name, images, tmp_path) -> None:
    # a captioner's or VLM's page explains each generated word: a class target would be ignored silently
    with pytest.raises(vx.errors.UsageError, match="is for classifiers"):
        vx.explore(vx.zoo.load(name), images[:1], tmp_path / "t.html", target=3)
    assert not (tmp_path / "t.html").exists()


def test_explore_refuses_a_prompt_for_a_model_without_one_and_a_bad_max_len(shapes_vit, images, tmp_path) -> None:
    # a prompt only reaches vision-language models: elsewhere it would be ignored silently
    with pytest.raises(vx.errors.UsageError, match="prompt= is for vision-language models"):
        vx.explore(shapes_vit, images[:1], tmp_path / "t.html", prompt="what is in the image ?")
    with pytest.raises(vx.errors.UsageError, match="max_len must be a positive"):
        vx.explore(vx.zoo.load("shapes-captioner"), images[:1], tmp_path / "t.html", max_len=0)
    assert not (tmp_path / "t.html").exists()


def test_explore_takes_an_nhwc_batch_array_as_that_many_images(shapes_vit, tmp_path) -> None:
    batch = np.random.default_rng(0).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    data = _payload(vx.explore(shapes_vit, batch, tmp_path / "b.html", method="rollout").read_text())
    assert [im["name"] for im in data["images"]] == ["image 0", "image 1"]
    page = vx.explore(shapes_vit, (x for x in batch), tmp_path / "g.html", method="rollout")
    from_generator = _payload(page.read_text())
    assert from_generator["images"] == data["images"]
    for i, im in enumerate(data["images"]):  # each image's own map, as the Explainer gives it for that image alone
        expected = vx.Explainer(shapes_vit).explain(batch[i], method="rollout").maps[0].flatten().numpy()
        got = dequantize_rows(im["methods"][0]["maps"])[0]
        assert np.abs(got - expected).max() <= expected.max() / 510 * 1.001
