"""The explorer page fed what a new user passes: a class target as an int, a NumPy or tensor integer, one
per image; labels and names in any script and of any length; an output path that cannot be a file. The
page's contents are checked against the Explainer (its maps, through the page's colouring, see
tests/test_explorer_browser.py for the oracle and the browser set-up) and the model's own labels."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch

import vitexplain as vx
from vitexplain.explorer.quantize import dequantize_rows
from test_explorer_browser import Page, assert_overlay, browser  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _payload(path) -> dict:
    block = re.search(r'<script type="application/json" id="vx-data">(.*?)</script>', path.read_text(), re.S)
    return json.loads(block.group(1))


@pytest.fixture(scope="module")
def model():
    return vx.zoo.load("shapes-vit")


@pytest.fixture(scope="module")
def images():
    return vx.data.shapes(n=2, seed=21, num_objects=2).images


@pytest.mark.parametrize("target", [2, np.int64(2), torch.tensor(2), "triangle"])
def test_a_given_class_is_named_by_its_label_and_its_maps_are_that_classes(model, images, tmp_path, target):
    """A class index given as target was shown on the page as "2" (a tensor as "tensor(2)"), where the
    Explainer's target_names() says "triangle"."""
    path = vx.explore(model, images[:1], tmp_path / "p.html", method="cdam", target=target)
    card = _payload(path)["images"][0]
    assert card["targets"] == [{"index": 2, "label": "triangle", "score": None}]
    ex = vx.Explainer(model)
    want = ex.explain(images[:1], method="cdam", target=2).maps[0]
    got = dequantize_rows(card["methods"][0]["maps"])[0].reshape(want.shape)
    assert np.abs(got - want.numpy()).max() <= want.abs().max().item() / 254 + 1e-7  # half a quantisation step


def test_one_target_per_image(model, images, tmp_path):
    """A list of one class per image was resolved against each single image ('got 2 targets for a batch of
    1 images'): the page could not explain a different class in each image."""
    path = vx.explore(model, images, tmp_path / "p.html", method="cdam", target=[1, "star"])
    ex = vx.Explainer(model)
    for card, image, (index, label) in zip(_payload(path)["images"], images, [(1, "square"), (3, "star")]):
        assert card["targets"] == [{"index": index, "label": label, "score": None}]
        want = ex.explain([image], method="cdam", target=index).maps[0]
        got = dequantize_rows(card["methods"][0]["maps"])[0].reshape(want.shape)
        assert np.abs(got - want.numpy()).max() <= want.abs().max().item() / 254 + 1e-7
    with pytest.raises(vx.UsageError, match="got 3 targets for 2 images"):
        vx.explore(model, images, tmp_path / "q.html", method="cdam", target=[1, 2, 3])


def test_a_page_path_that_cannot_be_a_file_is_refused_before_any_work(model, images, tmp_path):
    """A path below a file was a bare FileExistsError after every map was computed; None a TypeError."""
    (tmp_path / "file").write_text("x")
    for out, message in ((tmp_path / "file" / "p.html", "is a file, not a folder"), (None, "must be a file path"),
                         ("", "must be a file path"), (tmp_path, "is a folder")):
        with pytest.raises(vx.UsageError, match=message):
            vx.explore(model, images[:1], out, method="rollout")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert vx.explore(model, images[:1], tmp_path / "new" / "deeper" / "p.html", method="rollout").is_file()


LABELS = ["\U0001F431 \u043a\u043e\u0448\u043a\u0430 " + "x" * 300, "\u05e9\u05dc\u05d5\u05dd", "a<b>&amp;\"'",
          "long label with spaces " * 20, "\u0645\u0631\u0628\u0639"]


def test_long_and_right_to_left_labels_stay_in_their_place(browser, model, images, tmp_path):
    """A label without spaces (300 characters) made its class button wider than the methods panel: it was
    drawn over the attention views, and the page scrolled sideways (7635 px wide in a 1300 px window); a
    long title and image name did the same. A right-to-left label pulled its score in front of it
    ("0.986 \u05e9\u05dc\u05d5\u05dd"). Every label and name is shown as given, in order, inside the window."""
    named = copy.deepcopy(model)
    named.pretrained_cfg = dict(named.pretrained_cfg or {}, label_names=LABELS)
    names = ["N" * 2000, "\u540d\u524d " * 100]
    path = vx.explore(named, images, tmp_path / "long.html", method=["cdam"], top_k=5, names=names, title="T" * 500)
    page = Page(browser, path)
    width = page.page.evaluate("window.innerWidth")
    assert page.page.evaluate("document.documentElement.scrollWidth") <= width
    assert page.page.locator("h2").all_text_contents() == names
    logits = vx.Explainer(named).explain(images, method="cdam").logits
    for card, row in zip(_payload(path)["images"], logits):
        order = torch.sigmoid(row).argsort(descending=True).tolist()  # shapes-vit is multi-label
        assert [p["label"] for p in card["predictions"]] == [LABELS[i] for i in order]
    panel = page.page.locator(".vx-panel:has(button[data-vx='class'])").first.bounding_box()
    buttons = page.page.locator(".vx-card").first.locator("button[data-vx='class']")
    for i in range(buttons.count()):
        box = buttons.nth(i).bounding_box()
        assert panel["x"] <= box["x"] and box["x"] + box["width"] <= panel["x"] + panel["width"] + 1
    # the score is drawn after (right of) its label, whatever the label's script
    order = page.page.evaluate(
        """() => Array.from(document.querySelectorAll("[data-vx=predictions] li, button[data-vx=class]")).map(n => {
             const text = n.textContent, cut = text.search(/ (\\u2014 )?[0-9.]+$/);
             const range = (a, b) => { const r = document.createRange(); const w = document.createTreeWalker(n, 4);
               let at = 0, t, s = null, e = null;
               while ((t = w.nextNode())) { const len = t.data.length;
                 if (s === null && a < at + len) s = [t, a - at]; if (e === null && b <= at + len) e = [t, b - at]; at += len; }
               r.setStart(s[0], s[1]); r.setEnd(e[0], e[1]); return r; };
             const score = range(text.length - 5, text.length).getBoundingClientRect();
             const line = Array.from(range(0, cut).getClientRects()).filter(r => Math.abs(r.top - score.top) < 2);
             return [text, line.every(r => r.right <= score.left + 1)]; })"""
    )
    assert order and all(ok for _, ok in order), [t for t, ok in order if not ok]
    assert page.close() == []


def test_one_name_is_a_name_not_its_letters(model, images, tmp_path):
    """names="photo" for one image was read as five names ('got 5 names for 1 images'), names="ab" for two
    images named them "a" and "b"."""
    path = vx.explore(model, images[:1], tmp_path / "p.html", method="rollout", names="photo \u00e9t\u00e9")
    assert [card["name"] for card in _payload(path)["images"]] == ["photo \u00e9t\u00e9"]
    with pytest.raises(vx.UsageError, match="got 1 names for 2 images"):
        vx.explore(model, images, tmp_path / "q.html", method="rollout", names="ab")


@pytest.mark.parametrize("method", [None, "rollout"])
def test_a_model_with_nan_outputs_gets_a_numerical_error_not_a_json_error(model, images, tmp_path, method):
    """With the default methods each was left out with a note, then the NaN predictions failed the page's JSON
    ('Out of range float values are not JSON compliant', a bare ValueError)."""
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.head.weight.fill_(float("nan"))
    with pytest.raises(vx.NumericalError, match="outputs are not finite"):
        vx.explore(broken, images[:1], tmp_path / "p.html", method=method)
    assert not (tmp_path / "p.html").exists()


def test_crop_must_be_a_bool(model, images, tmp_path):
    """crop="no" is truthy: the images were center-cropped when the caller asked for the whole image."""
    with pytest.raises(vx.UsageError, match="crop must be True or False"):
        vx.explore(model, images[:1], tmp_path / "p.html", method="rollout", crop="no")
    with pytest.raises(vx.UsageError, match="crop must be True or False"):
        vx.Explainer(model).preprocess(images[0], crop="no")


@pytest.mark.parametrize("title", [None, 5])
def test_a_title_that_is_not_text_is_refused_before_any_work(model, images, tmp_path, title):
    """title=None was an AttributeError from the HTML escaping, after every map was computed."""
    with pytest.raises(vx.UsageError, match="title must be a string"):
        vx.explore(model, images[:1], tmp_path / "p.html", method="rollout", title=title)


def test_a_tensor_is_told_to_pass_the_images(model, images, tmp_path):
    """A preprocessed tensor was told to 'convert with np.clip(x * 255, ...)' (explain's advice for a float
    image), which would draw the normalised values as pixels."""
    x = vx.Explainer(model).preprocess(images[0])[0]
    for given in (x, [x[0]]):
        with pytest.raises(vx.UsageError, match="pass the images themselves") as info:
            vx.explore(model, given, tmp_path / "p.html", method="rollout")
        assert "255" not in str(info.value)


def test_a_map_that_is_zero_everywhere_says_so(browser, model, images, tmp_path):
    """An all-zero map (e.g. attn_gradcam when every head's weight is negative) was drawn in one faint colour
    under a legend reading "0 .. max", as if it were a map of small values."""
    from vitexplain.explorer.page import render_page
    from vitexplain.explorer.quantize import quantize_rows

    data = _payload(vx.explore(model, images[:1], tmp_path / "a.html", method=["cdam", "rollout"], top_k=1))["images"]
    q = data[0]["methods"][0]["maps"]
    assert data[0]["methods"][0]["name"] == "cdam"
    data[0]["methods"][0]["maps"] = quantize_rows(np.zeros((q["rows"], q["cols"])), signed=True)
    path = tmp_path / "zero.html"
    path.write_text(render_page(data, title="zero"), encoding="utf-8")
    page = Page(browser, path)
    info = page.page.locator(".vx-panel:has(button[data-vx='class']) .vx-info").first
    assert info.text_content().startswith("cdam: ") and info.text_content().endswith("this map is zero everywhere")
    page.page.click('button[data-vx="method-tab"]:text-is("rollout")')
    assert info.text_content().startswith("rollout: ") and "zero everywhere" not in info.text_content()
    assert page.close() == []
