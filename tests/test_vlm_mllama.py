"""mllama (Llama 3.2 Vision): the image enters through cross-attention layers over the tiles' vision tokens.

The shared checks of tests/vlm_checks.py (the image changes the logits, a padded batch equals each image
alone, the default answer is the model's greedy ``generate``, footprints) plus: ``cross``, ``cross_grad``
and ``cross_generic`` equal their definitions computed here from an eager copy's ``output_attentions``
(cross-attention layers for the image, self-attention layers for ``cross_generic``'s encoder-decoder
rules); a batch of images with different tile layouts equals each image alone; and the model is left
as found.
"""

from __future__ import annotations

import copy

import pytest
import torch

import vitexplain as vx
import vlm_helpers as helpers
from vlm_checks import (  # noqa: F401  (the shared tests)
    _answer_ids, _oracle_inputs, check_footprints, family, test_a_padded_batch_equals_each_image_alone,
    test_each_token_covers_the_pixels_that_change_it, test_the_default_answer_is_the_models_greedy_generation,
    test_the_image_changes_the_logits)

built = family(["mllama"])
PROMPTS = ["what is", "what color is the shape"]
ANSWERS = [["red", "circle", "on", "the"], ["blue", "square"]]
#: a wide image (1 x 3 tiles), a tall one (3 x 1) and a square one (2 x 2): different tile layouts
SIZES = ((20, 60), (50, 22), (30, 30))


def _normbar(r: torch.Tensor) -> torch.Tensor:
    """Chefer's ``rownorm(R - I) + I`` (rows of R - I that are all zero stay zero)."""
    off = r - torch.eye(r.shape[-1])
    sums = off.sum(-1, keepdim=True)
    return torch.where(sums == 0, torch.zeros_like(off), off / torch.where(sums == 0, torch.ones_like(sums), sums)) \
        + torch.eye(r.shape[-1])


def _columns(model, batch):
    """Per image, the cross-attention keys of its real tiles' patch tokens (class tokens dropped)."""
    vision = model.config.vision_config
    per_tile = (vision.image_size // vision.patch_size) ** 2 + 1
    out = []
    for row in batch["aspect_ratio_mask"][:, 0]:
        keys = torch.arange(int(row.sum()) * per_tile)
        out.append(keys[keys % per_tile != 0])
    return out


def oracle(model, proc, images, prompts, answers, heads=None):
    """Per method, per image (T, n) scores from an eager copy (definitions in docs/methods.md)."""
    eager = helpers.eager_copy(model)
    kwargs, start, ids, _ = _oracle_inputs("mllama", model, proc, images, prompts, answers)
    batch = proc(images=[[i] for i in images], text=[helpers.ORACLE["mllama"]["prompt"](p) for p in prompts], padding=True,
                 padding_side="left", return_tensors="pt")
    columns = _columns(model, batch)
    lengths = torch.tensor([len(a) for a in answers])
    t = ids.shape[1]
    with torch.enable_grad():
        out = eager(**kwargs, output_attentions=True, use_cache=False)
    cross_layers = model.config.text_config.cross_attention_layers
    kinds = ["cross" if i in cross_layers else "self" for i in range(len(out.attentions))]
    cross = [a for a, kind in zip(out.attentions, kinds) if kind == "cross"]
    rows = slice(start - 1, start - 1 + t)
    n, k = out.attentions[kinds.index("self")].shape[-1], cross[0].shape[-1]
    scores = {"cross": torch.stack([a[:, :, rows].float().mean(1) for a in cross]).mean(0),
              "cross_max": torch.stack([a[:, :, rows].float().amax(1) for a in cross]).mean(0),
              "cross_grad": torch.zeros(ids.shape[0], t, k), "cross_generic": torch.zeros(ids.shape[0], t, k)}
    if heads is not None:
        scores["cross_heads"] = torch.stack([cross[layer][:, head, rows] for layer, head in heads]).mean(0)
    log_probs = torch.log_softmax(out.logits.float(), -1)
    for word in range(t):
        row = start - 1 + word
        chosen = log_probs[:, row].gather(1, ids[:, word : word + 1])[:, 0]
        grads = torch.autograd.grad((chosen * (lengths > word)).sum(), list(out.attentions), retain_graph=True)
        abar = [(a * g).clamp(min=0).mean(1) for a, g in zip(out.attentions, grads)]
        scores["cross_grad"][:, word] = torch.stack([x[:, row] for x, kind in zip(abar, kinds) if kind == "cross"]).mean(0)
        r_tt = torch.eye(n).expand(ids.shape[0], n, n).clone()
        r_ti = torch.zeros(ids.shape[0], n, k)
        for x, kind in zip(abar, kinds):
            if kind == "self":
                r_tt, r_ti = r_tt + x @ r_tt, r_ti + x @ r_ti
            else:  # R_ii = I: the vision tower's attention is not propagated
                r_ti = r_ti + torch.stack([_normbar(r).T for r in r_tt]) @ x
        scores["cross_generic"][:, word] = r_ti[:, row]
    result = {}
    for method, value in scores.items():
        per_image = [value[b, :, cols].detach() for b, cols in enumerate(columns)]
        for b, length in enumerate(lengths.tolist()):
            per_image[b][length:] = 0
        result[method] = per_image
    return result


@pytest.mark.parametrize("prompts", [PROMPTS, ["a the <|image|> what is", "what <|image|> color is the shape"]],
                         ids=["image first", "text before the image"])
def test_methods_equal_the_eager_oracle(built, prompts):
    """Also with text before ``<|image|>`` (a chat template's header): those rows read every key (padding tiles
    included: transformers unmasks a row that sees no tile) and carry that into later rows through self-attention."""
    _, model, proc = built
    images = helpers.images(2, SIZES[:2])
    answers = _answer_ids(proc, ANSWERS)
    heads = [(1, 0), (0, 3), (1, 2)]
    ex = vx.Explainer(model, processor=proc)
    assert list(ex.methods()) == ["cross", "cross_grad", "cross_generic", "attnlrp", "cp_lrp"]  # (LRP: test_vlm_lrp.py)
    explained = ex.explain_caption(images, method=["cross", "cross_grad", "cross_generic"], caption=answers, prompt=prompts)
    explained.append(ex.explain_caption(images, method="cross", caption=answers, prompt=prompts, head_fusion="max"))
    explained.append(ex.explain_caption(images, method="cross", caption=answers, prompt=prompts, heads=heads))
    expected = oracle(model, proc, images, prompts, answers, heads=heads)
    assert model.config.text_config._attn_implementation == "sdpa"  # the model kept its fused attention
    for e, key in zip(explained, ("cross", "cross_grad", "cross_generic", "cross_max", "cross_heads")):
        assert e.tokens == ANSWERS
        for b, (got, want) in enumerate(zip(e.token_scores, expected[key])):
            assert got.shape == want.shape == (4, 16 * 3)  # 3 tiles of 4 x 4 patches
            assert float(want.abs().max()) > 0
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")
        for b, image in enumerate(images):
            assert e.image_maps[b].shape == (4, *image.shape[:2])


def test_the_cross_attention_layers_are_what_the_methods_read(built):
    """cross_generic differs from the per-layer gradient term (the self-attention layers carry relevance), and
    the image keys a word reads sum to at most 1 per cross-attention row (class tokens take the rest)."""
    _, model, proc = built
    images = helpers.images(5, SIZES[:2])
    ex = vx.Explainer(model, processor=proc)
    grad, generic, cross = ex.explain_caption(images, method=["cross_grad", "cross_generic", "cross"],
                                              caption=_answer_ids(proc, ANSWERS), prompt=PROMPTS)
    assert float((grad.token_scores[0] - generic.token_scores[0]).abs().max()) > 1e-6
    for scores in cross.token_scores:
        assert bool((scores.sum(-1) <= 1 + 1e-5).all()) and bool((scores.sum(-1)[: len(ANSWERS[1])] > 0.5).all())
    with pytest.raises(vx.errors.OptionError):
        ex.explain_caption(images, method="cross", caption=_answer_ids(proc, ANSWERS), prompt=PROMPTS, heads=[(2, 0)])


@pytest.mark.parametrize("given", [True, False], ids=["given answers", "generated"])
def test_images_with_different_tile_layouts_equal_each_image_alone(built, given):
    _, model, proc = built
    images = helpers.images(7, SIZES)
    prompts = PROMPTS + ["what is there"]
    answers = _answer_ids(proc, ANSWERS + [["green", "triangle", "left"]]) if given else None
    ex = vx.Explainer(model, processor=proc)
    views = ex.adapter.views(images, ex.adapter.prepare(images, prompts))
    assert [[p.name for p in v.pieces] for v in views] == [  # the three layouts differ
        ["tile 0,0", "tile 0,1", "tile 0,2"], ["tile 0,0", "tile 1,0", "tile 2,0"],
        ["tile 0,0", "tile 0,1", "tile 1,0", "tile 1,1"]]
    methods = ["cross", "cross_grad", "cross_generic"]
    together = ex.explain_caption(images, method=methods, caption=answers, prompt=prompts, max_len=4)
    for b, image in enumerate(images):
        alone = ex.explain_caption([image], method=methods, caption=None if answers is None else [answers[b]],
                                   prompt=prompts[b], max_len=4)
        for e_all, e_one in zip(together, alone):
            n = len(e_one.tokens[0])
            assert e_all.ids[b, :n].tolist() == e_one.ids[0, :n].tolist()
            torch.testing.assert_close(e_all.token_scores[b][:n], e_one.token_scores[0][:n], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(e_all.image_maps[b][:n], e_one.image_maps[0][:n], atol=1e-5, rtol=1e-4)


def test_each_token_covers_the_pixels_that_change_it_in_a_row_of_tiles(built):
    check_footprints(built, (22, 70))


def test_each_token_covers_the_pixels_that_change_it_with_the_pil_image_processor(built):
    """The processor's other backend (PIL resize) tiles the same way."""
    import transformers

    name, model, proc = built
    image = transformers.MllamaImageProcessorPil(size=dict(proc.image_processor.size), max_image_tiles=4)
    check_footprints((name, model, transformers.MllamaProcessor(image_processor=image, tokenizer=proc.tokenizer)), (50, 22))


def test_the_model_is_left_as_found(built):
    _, model, proc = built
    state = copy.deepcopy(model.state_dict())
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    implementations = {n: getattr(m.config, "_attn_implementation", None) for n, m in model.named_modules()
                       if hasattr(m, "config")}
    hooks = {n: (list(m._forward_hooks), list(m._forward_pre_hooks), list(m._backward_hooks)) for n, m in model.named_modules()}
    vx.Explainer(model, processor=proc).explain_caption(helpers.images(8, SIZES[:1]), method=["cross", "cross_generic"],
                                                        prompt="what is", max_len=3)
    assert not model.training
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())
    assert {n: getattr(m.config, "_attn_implementation", None) for n, m in model.named_modules()
            if hasattr(m, "config")} == implementations
    assert {n: (list(m._forward_hooks), list(m._forward_pre_hooks), list(m._backward_hooks))
            for n, m in model.named_modules()} == hooks
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_the_explorer_page_shows_the_cross_attention_over_the_tiles(built, tmp_path):
    """The page's attention views: per cross-attention layer and head, the predicting rows over the pixel-bearing
    keys (class tokens dropped), in the order of the per-token scores drawn over the tiles."""
    import json
    import re

    from vitexplain.explorer.quantize import dequantize_rows

    _, model, proc = built
    image = helpers.images(9, SIZES[:1])[0]
    path = vx.explore(model, [image], tmp_path / "mllama.html", processor=proc, prompt="what is", max_len=3)
    text = path.read_text(encoding="utf-8")
    v = json.loads(re.search(r'<script type="application/json" id="vx-data">(.*?)</script>', text, re.S).group(1))
    v = v["images"][0]["vlm"]
    assert [p["name"] for p in v["pieces"]] == ["tile 0,0", "tile 0,1", "tile 0,2"] and v["tokens"] == 48
    ids = _answer_ids(proc, [v["words"]])
    kwargs, start, ids, _ = _oracle_inputs("mllama", model, proc, [image], ["what is"], ids)
    with torch.no_grad():
        out = helpers.eager_copy(model)(**kwargs, output_attentions=True, use_cache=False)
    keys = torch.arange(3 * 17)
    rows = torch.arange(start - 1, start - 1 + ids.shape[1])
    cross = model.config.text_config.cross_attention_layers
    oracle = torch.stack([out.attentions[i][0][:, rows][:, :, keys[keys % 17 != 0]] for i in cross]).numpy()
    att = v["attention"]
    assert att["layerIndex"] == [0, 1] and att["words"] == ids.shape[1]
    got = dequantize_rows(att["probs"]).reshape(oracle.shape)
    assert abs(got - oracle).max() <= oracle.max(axis=-1, keepdims=True).max() / 255 * 0.5 + 1e-5
