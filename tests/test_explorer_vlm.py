"""The explorer on a vision-language model: the answer's words, each method's per-token scores over
the image-token grid, and the language model's attention per layer and head from the row that
predicts each word (against an eager-attention copy's ``output_attentions``)."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch

import vitexplain as vx
from peers import require
from vitexplain.explorer.quantize import dequantize_rows

transformers = require("transformers", "pip install -e '.[test]' (the explorer's VLM pages)")

PROMPT = "describe the image"


def tiny_llava():
    """A tiny random LLaVA of the shapes-vlm architecture (2 + 2 layers) and its processor."""
    from vitexplain.zoo.vlm import VLM_ARGS, build_llava, build_processor

    args = copy.deepcopy(VLM_ARGS)
    args["vision"].update(num_hidden_layers=2)
    args["text"].update(num_hidden_layers=2)
    torch.manual_seed(0)
    model = build_llava(args).eval()
    with torch.no_grad():  # sharper attention than the random init gives
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model, build_processor(args)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    model, processor = tiny_llava()
    image = vx.data.shapes(1, seed=10_903, num_objects=2).images[0]
    path = vx.explore(model, [image], tmp_path_factory.mktemp("vlm") / "vlm.html", processor=processor,
                      prompt=PROMPT, max_len=4)
    text = path.read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script type="application/json" id="vx-data">(.*?)</script>', text, re.S).group(1))
    return path, data["images"][0], model, processor, image


def _eager_rows(model, processor, image, ids: torch.Tensor) -> np.ndarray:
    """(L, H, T, n): an eager copy's attention from each answer word's predicting row to the image tokens."""
    eager = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    inputs = processor(images=[image], text=["<image>" + PROMPT], return_tensors="pt")
    start = inputs["input_ids"].shape[1]
    full = torch.cat([inputs["input_ids"], ids], dim=1)
    with torch.no_grad():
        out = eager(input_ids=full, pixel_values=inputs["pixel_values"], attention_mask=torch.ones_like(full),
                    output_attentions=True)
    cols = (full[0] == model.config.image_token_index).nonzero()[:, 0]
    rows = torch.arange(start - 1, start - 1 + ids.shape[1])
    return torch.stack([a[0][:, rows][:, :, cols] for a in out.attentions]).numpy()


def test_vlm_page_holds_words_token_scores_and_attention(page) -> None:
    path, data, model, processor, image = page
    v = data["vlm"]
    ex = vx.Explainer(model, processor=processor)
    expected = ex.explain_caption([image], method=["cross", "cross_generic"], prompt=PROMPT, max_len=4)
    words = expected[0].tokens[0]
    assert v["words"] == words and data["predictions"][0]["label"] == " ".join(words)
    assert v["prompt"] == PROMPT and data["family"] == "vlm"
    assert v["pieces"] == [{"name": "image", "grid": [8, 8], "start": 0, "clamp": False,
                           "box": [0.0, 0.0, 1.0, 1.0]}]
    assert v["tokens"] == 64 and data["size"] == [64, 64]
    for entry, e in zip(v["methods"], expected):
        assert entry["name"] == e.method
        scores = e.token_scores[0][: len(words)].numpy()
        step = np.abs(scores).max(axis=1, keepdims=True) / (127 if entry["maps"]["signed"] else 255)
        assert np.all(np.abs(dequantize_rows(entry["maps"]) - scores) <= 0.5 * step + 1e-7)
    att = v["attention"]
    assert att["layerIndex"] == [0, 1] and att["heads"] == ["0", "1", "2", "3"] and att["words"] == len(words)
    oracle = _eager_rows(model, processor, image, expected[0].ids[:, : len(words)])  # (L, H, T, n)
    got = dequantize_rows(att["probs"]).reshape(oracle.shape)
    step = oracle.max(axis=-1, keepdims=True) / 255
    assert np.all(np.abs(got - oracle) <= 0.5 * step + 1e-5)
    assert path._repr_html_().startswith("<iframe")


def test_vlm_attention_degrades_to_fewer_layers_then_head_mean(page) -> None:
    from vitexplain.explorer.vlm import vlm_attention

    _, data, model, processor, image = page
    ex = vx.Explainer(model, processor=processor)
    adapter = ex.adapter
    inputs = adapter.prepare([image], [PROMPT])
    ids = torch.tensor([[5, 10, 14, 6]])
    full = vlm_attention(adapter, inputs, ids, budget=10**7)
    one_layer = vlm_attention(adapter, inputs, ids, budget=2000)  # fits one layer of 4 heads x 4 words x 64
    assert full["layerIndex"] == [0, 1] and full["note"] == ""
    assert one_layer["layerIndex"] == [1] and "1 of 2 layers" in one_layer["note"]
    np.testing.assert_array_equal(dequantize_rows(one_layer["probs"]), dequantize_rows(full["probs"])[16:])
    fused = vlm_attention(adapter, inputs, ids, budget=600)
    assert fused["heads"] == ["mean"] and "heads fused" in fused["note"]
    mean = dequantize_rows(full["probs"]).reshape(2, 4, 4, 64).mean(1)
    got = dequantize_rows(fused["probs"]).reshape(-1, 4, 64)
    np.testing.assert_allclose(got, mean[-len(got):], atol=mean.max() / 255)


@pytest.mark.parametrize("name", ["blip2", "kosmos2", "idefics2"])
def test_a_qformer_page_draws_the_patches_the_queries_reach(name, tmp_path) -> None:
    """BLIP-2 / Kosmos-2 / Idefics2: the language model's image tokens are learned queries (4 here; Kosmos-2: 64;
    Idefics2: 4 latents per piece), not the patch grids the page draws. The page put the queries' scores on the patch
    grids (BLIP-2: 4 values drawn over 16 cells; Kosmos-2: the first 16 of 64 queries as if they were patches;
    Idefics2: 20 latents' over 40 patches), silently. Now each method's rows, and the attention
    rows, are over the patches, through the Q-Former's cross-attention: rendered, a method's row is the API's map of
    that word (within the page's 8-bit steps), and the attention rows averaged over every layer and head are cross's."""
    import vlm_helpers as helpers

    model, processor = helpers.BUILDERS[name]()
    image = helpers.images(41, ((37, 58),))[0]  # (not the processor's square: the patch box is the whole image)
    path = vx.explore(model, [image], tmp_path / "q.html", processor=processor, prompt="what is", max_len=3,
                      method=["cross", "cross_generic"])
    data = json.loads(re.search(r'<script type="application/json" id="vx-data">(.*?)</script>',
                                path.read_text(encoding="utf-8"), re.S).group(1))
    v = data["images"][0]["vlm"]
    ex = vx.Explainer(model, processor=processor)
    expected = ex.explain_caption([image], method=["cross", "cross_generic"], prompt="what is", max_len=3)
    t = max(len(v["words"]), 1)
    view = ex.adapter.views([image], ex.adapter.prepare([image], ["what is"]))[0]
    n = view.num_tokens  # the patches, not the queries
    assert v["tokens"] == n != expected[0].token_scores[0].shape[-1]
    for entry, e in zip(v["methods"], expected):
        rows = torch.from_numpy(dequantize_rows(entry["maps"]))
        assert rows.shape == (t, n)
        want = e.image_maps[0][:t]
        got = vx.adapters.vlm.render(rows, view)[0]
        step = want.flatten(1).abs().amax(1)[:, None, None] / 255
        assert float(want.abs().max()) > 0 and bool(((got - want).abs() <= step + 1e-7).all()), entry["name"]
    att = v["attention"]
    probs = dequantize_rows(att["probs"]).reshape(len(att["layers"]), len(att["heads"]), t, n)
    cross = expected[0].image_maps[0][:t]
    got = vx.adapters.vlm.render(torch.from_numpy(probs.mean((0, 1))), view)[0]
    step = torch.from_numpy(probs.max(axis=(0, 1, 3)))[:, None, None] / 255  # (each row rounded to its own max / 255)
    assert float(cross.abs().max()) > 0 and bool(((got - cross).abs() <= step + 1e-7).all())
