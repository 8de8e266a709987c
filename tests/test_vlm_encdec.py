"""Florence-2 and Pix2Struct: encoder-decoder vision-language models, explained through the decoder's cross-attention.

Tiny random-init builds (``tests/encdec_helpers.py``). For each: the image changes the logits; ``cross``,
``cross_grad`` and ``cross_generic`` on the model's SDPA equal the definitions (docs/methods.md,
"Vision-language models") computed here from an eager copy's ``output_attentions`` and
``torch.autograd.grad`` (1e-5); a padded batch of two images of different sizes equals each image
alone; the default answer is the model's own greedy ``generate``; the model is left as found; and each
token's pixels (the adapter's geometry) are the pixels that reach it (footprint probes below).
"""

from __future__ import annotations

import copy

import numpy as np

import pytest
import torch

import vitexplain as vx
import encdec_helpers
import vlm_helpers as helpers

METHODS = ("cross", "cross_grad", "cross_generic")
PROMPTS = ["what is", "what color is the shape"]
ANSWERS = [["red", "circle", "on", "the"], ["blue", "square"]]


@pytest.fixture(scope="module", params=list(encdec_helpers.BUILDERS))
def built(request):
    model, proc = encdec_helpers.BUILDERS[request.param]()
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "pix2struct_vqa":
            encdec_helpers.local_font(patch)  # (offline: no font download)
        yield request.param, model, proc


def _ids(proc, words):
    return [[proc.tokenizer.convert_tokens_to_ids(w) for w in ws] for ws in words]


def _oracle_inputs(name, model, proc, images, prompts, answers):
    """The teacher-forced inputs built here: (kwargs, L, answer ids (B, T), per image its image-token encoder positions)."""
    t = max(len(a) for a in answers)
    pad = proc.tokenizer.pad_token_id
    ids = torch.tensor([a + [pad] * (t - len(a)) for a in answers], dtype=torch.long)
    start = model.config.get_text_config(decoder=True).decoder_start_token_id
    if name == "florence2":  # the processor's own (right) padding; the decoder starts from its start token
        kwargs = dict(proc(images=images, text=prompts, padding=True, return_tensors="pt"))
        kwargs["decoder_input_ids"] = torch.cat([torch.full((len(images), 1), start), ids], 1)
        columns = [row.nonzero()[:, 0] for row in kwargs["input_ids"] == model.config.image_token_id]
        return kwargs, 1, ids, columns
    if name == "pix2struct_vqa":  # the question is rendered above the image; the decoder starts from its start token
        kwargs = dict(proc(images=images, text=prompts, return_tensors="pt", max_patches=proc.image_processor.max_patches))
        kwargs["decoder_input_ids"] = torch.cat([torch.full((len(images), 1), start), ids], 1)
        return kwargs, 1, ids, [torch.arange(int(m.sum())) for m in kwargs["attention_mask"]]
    kwargs = dict(proc(images=images, return_tensors="pt", max_patches=proc.image_processor.max_patches))
    prefixes = [[start] + proc.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    length = max(len(p) for p in prefixes)
    kwargs["decoder_input_ids"] = torch.cat([torch.tensor([[pad] * (length - len(p)) + p for p in prefixes]), ids], 1)
    kwargs["decoder_attention_mask"] = torch.cat(
        [torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prefixes]), torch.ones_like(ids)], 1)
    columns = [torch.arange(int(m.sum())) for m in kwargs["attention_mask"]]  # the real patches come first
    return kwargs, length, ids, columns


def _normbar(r):
    eye = torch.eye(r.shape[-1])
    off = r - eye
    sums = off.sum(-1, keepdim=True)
    return torch.where(sums == 0, 0.0, off / torch.where(sums == 0, 1.0, sums)) + eye


def oracle(name, model, proc, images, prompts, answers):
    """Per method, per image (T, n) scores from an eager copy."""
    eager = helpers.eager_copy(model)
    kwargs, start, ids, columns = _oracle_inputs(name, model, proc, images, prompts, answers)
    lengths = torch.tensor([len(a) for a in answers])
    t = ids.shape[1]
    with torch.enable_grad():
        out = eager(**kwargs, output_attentions=True, use_cache=False)
    enc, dec, cross = list(out.encoder_attentions), list(out.decoder_attentions), list(out.cross_attentions)
    rows = slice(start - 1, start - 1 + t)
    b, n_e, n_d = ids.shape[0], enc[0].shape[-1], dec[0].shape[-1]
    scores = {"cross": torch.stack([a[:, :, rows].float().mean(1) for a in cross]).mean(0),
              "cross_grad": torch.zeros(b, t, n_e), "cross_generic": torch.zeros(b, t, n_e)}
    log_probs = torch.log_softmax(out.logits.float(), -1)
    for word in range(t):
        chosen = log_probs[:, start - 1 + word].gather(1, ids[:, word : word + 1])[:, 0]
        grads = torch.autograd.grad((chosen * (lengths > word)).sum(), enc + dec + cross, retain_graph=True)
        abar = [(a * g).clamp(min=0).mean(1) for a, g in zip(enc + dec + cross, grads)]
        a_enc, a_dec, a_cross = abar[: len(enc)], abar[len(enc) : len(enc) + len(dec)], abar[len(enc) + len(dec) :]
        scores["cross_grad"][:, word] = torch.stack([x[:, start - 1 + word] for x in a_cross]).mean(0)
        r_ee = torch.eye(n_e).repeat(b, 1, 1)
        for x in a_enc:
            r_ee = r_ee + x @ r_ee
        r_dd, r_de = torch.eye(n_d).repeat(b, 1, 1), torch.zeros(b, n_d, n_e)
        for self_attn, cross_attn in zip(a_dec, a_cross):  # each decoder layer: self-attention, then cross-attention
            r_dd, r_de = r_dd + self_attn @ r_dd, r_de + self_attn @ r_de
            r_de = r_de + _normbar(r_dd).transpose(1, 2) @ cross_attn @ _normbar(r_ee)
        scores["cross_generic"][:, word] = r_de[:, start - 1 + word]
    result = {}
    for method, value in scores.items():
        per_image = [value[i, :, cols].detach().clone() for i, cols in enumerate(columns)]
        for i, n in enumerate(lengths.tolist()):
            per_image[i][n:] = 0
        result[method] = per_image
    return result


def test_the_image_changes_the_logits(built):
    name, model, proc = built
    a, b = helpers.images(1, ((32, 32), (32, 32)))
    logits = []
    for image in (a // 4, 192 + b // 4):  # a dark and a bright image
        kwargs, _, _, _ = _oracle_inputs(name, model, proc, [image], ["what is"], [[5]])
        with torch.no_grad():
            logits.append(model(**kwargs).logits[0, -1])
    assert float((logits[0] - logits[1]).abs().max()) > 1e-3  # a map of an image the model ignores means nothing


def test_methods_equal_the_eager_oracle(built):
    name, model, proc = built
    images = helpers.images(2)
    answers = _ids(proc, ANSWERS)
    explained = vx.Explainer(model, processor=proc).explain_caption(images, method=list(METHODS), caption=answers,
                                                                    prompt=PROMPTS)
    expected = oracle(name, model, proc, images, PROMPTS, answers)
    assert model.config.get_text_config(decoder=True)._attn_implementation == "sdpa"  # kept its fused attention
    for e in explained:
        for got, want in zip(e.token_scores, expected[e.method]):
            assert got.shape == want.shape
            assert float(want.abs().max()) > 0
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"{e.method}: {m}")
        assert e.tokens == ANSWERS
        for b, image in enumerate(images):
            assert e.image_maps[b].shape == (4, *image.shape[:2])


def test_a_padded_batch_equals_each_image_alone(built):
    _, model, proc = built
    images = helpers.images(3)  # 40 x 52 and 30 x 30: other patch grids (Pix2Struct), other prompt lengths
    ex = vx.Explainer(model, processor=proc)
    together = ex.explain_caption(images, method=list(METHODS), prompt=PROMPTS, max_len=4)
    assert max(len(w) for w in together[0].tokens) >= 2  # generation gave words to compare
    for b, image in enumerate(images):
        alone = ex.explain_caption([image], method=list(METHODS), prompt=PROMPTS[b], max_len=4)
        for e_all, e_one in zip(together, alone):
            n = len(e_one.tokens[0])
            assert e_all.ids[b, :n].tolist() == e_one.ids[0, :n].tolist() and e_all.tokens[b] == e_one.tokens[0]
            torch.testing.assert_close(e_all.token_scores[b][:n], e_one.token_scores[0][:n], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(e_all.image_maps[b][:n], e_one.image_maps[0][:n], atol=1e-5, rtol=1e-4)


def test_the_default_answer_is_the_models_greedy_generation(built):
    name, model, proc = built
    images = helpers.images(4)
    e = vx.Explainer(model, processor=proc).explain_caption(images, prompt=PROMPTS, max_len=5)
    assert e.method == "cross"
    for b, image in enumerate(images):
        kwargs, start, _, _ = _oracle_inputs(name, model, proc, [image], [PROMPTS[b]], [[]])
        kwargs["decoder_input_ids"] = kwargs["decoder_input_ids"][:, :start]
        kwargs.pop("decoder_attention_mask", None)  # one image: no padding
        suppress = [model.config.image_token_id] if name == "florence2" else None
        with torch.no_grad():
            out = model.generate(**kwargs, max_new_tokens=5, do_sample=False, suppress_tokens=suppress)[0, start:].tolist()
        end = proc.tokenizer.eos_token_id
        out = out[: out.index(end)] if end in out else out
        assert out and e.ids[b, : len(out)].tolist() == out


def test_the_model_is_left_as_found(built):
    _, model, proc = built
    hooks = {n: (list(m._forward_hooks), list(m._forward_pre_hooks)) for n, m in model.named_modules()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {n: getattr(m.config, "_attn_implementation", None) for n, m in model.named_modules() if hasattr(m, "config")}
    vx.Explainer(model, processor=proc).explain_caption(helpers.images(5), method="cross_generic", prompt=PROMPTS, max_len=2)
    assert all(p.grad is None for p in model.parameters()) and not model.training
    assert {n: getattr(m.config, "_attn_implementation", None) for n, m in model.named_modules() if hasattr(m, "config")} == modes
    assert {n: (list(m._forward_hooks), list(m._forward_pre_hooks)) for n, m in model.named_modules()} == hooks
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _token_map(adapter, images, prompts):
    """The adapter's geometry rendered: per piece, (H, W) index (1-based) of the token each pixel is given to."""
    inputs = adapter.prepare(images, prompts)
    view = adapter.views(images, inputs)[0]
    _, layers = vx.adapters.vlm.render(torch.arange(1, view.num_tokens + 1, dtype=torch.float64)[None], view)
    return view, [layer[0].long() for layer in layers]


def test_florence_tokens_sit_on_davit_receptive_fields():
    """Probe (a copy whose DaViT mixes tokens only through its patch-embedding convolutions: window and channel
    attention output projections and the depthwise positional convolutions zeroed): perturb every pixel of a
    32 x 32 image (the processed size, so no resize) and record which image tokens change. Every pixel must reach
    the grid token the adapter draws it on, and the pooled token; each interior token's cell must be centred on the
    pixels that reach it (a uniform grid would be 3.5 px off: the convolutions' receptive fields are centred on
    the top-left corner of the uniform cells); pixels that reach a single grid token are drawn on it."""
    model, proc = encdec_helpers.florence2()
    probe = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in probe.model.vision_tower.named_modules():
            if name.endswith(("attn.proj", "conv1", "conv2")):
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()
    image = helpers.images(6, ((32, 32),))[0]
    ex = vx.Explainer(model, processor=proc)
    view, (pooled, grid) = _token_map(ex.adapter, [image], [""])
    assert [p.name for p in view.pieces] == ["pooled", "image"] and bool((pooled == 1).all())
    pixels = proc.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    h, w = pixels.shape[-2:]
    bumped = pixels.repeat(h * w, 1, 1, 1)
    bumped.view(h * w, 3, h * w)[torch.arange(h * w), :, torch.arange(h * w)] += 1.0
    with torch.no_grad():
        base = probe.get_image_features(pixel_values=pixels).pooler_output[0]
        change = torch.cat([(probe.get_image_features(pixel_values=chunk).pooler_output - base).abs().amax(-1)
                            for chunk in bumped.split(256)])  # (H * W, 17)
    reached = (change > 1e-5 * float(change.max())).view(h, w, -1)
    assert bool(reached[..., 0].all())  # the pooled token (the mean of the grid) reaches every pixel
    drawn = grid - 2  # grid token index (0-based) each pixel is drawn on
    assert bool(reached[..., 1:].gather(-1, drawn[..., None]).all())  # every pixel reaches its token
    single = reached[..., 1:].sum(-1) == 1
    assert int(single.sum()) > 0 and bool((reached[..., 1:].float().argmax(-1) == drawn)[single].all())
    gh, gw = view.pieces[1].grid
    for r in range(1, gh - 1):
        for c in range(1, gw - 1):
            ys, xs = reached[..., 1 + r * gw + c].nonzero(as_tuple=True)
            cys, cxs = (drawn == r * gw + c).nonzero(as_tuple=True)
            assert abs(float(ys.min() + ys.max()) / 2 - float(cys.min() + cys.max()) / 2) <= 0.5
            assert abs(float(xs.min() + xs.max()) / 2 - float(cxs.min() + cxs.max()) / 2) <= 0.5


@pytest.mark.parametrize("vqa", [False, True])
def test_pix2struct_patches_cover_the_pixels_that_change_them(vqa, monkeypatch):
    """Probe: perturb one original pixel of a 74 x 90 image (captioning: the processor resizes it to 4 x 5 patches of
    8 px; VQA: the question is rendered above it first, and the canvas is cut into 7 x 6 patches) and read the patch
    embeddings (before any attention): the patch that changes most is the one the adapter draws that pixel on
    (pixels within 4 px of a cell border skipped: the resizes blend across it); VQA: the header's patches (above
    the image) hold no pixel of it."""
    model, proc = encdec_helpers.pix2struct(vqa=vqa)
    if vqa:
        encdec_helpers.local_font(monkeypatch)
    image = helpers.images(6, ((74, 90),))[0]
    ex = vx.Explainer(model, processor=proc)
    view, (grid,) = _token_map(ex.adapter, [image], ["what is"])
    rows, cols = view.pieces[0].grid
    assert (rows, cols) == ((7, 6) if vqa else (4, 5))
    header = int(grid.min()) - 1  # tokens before the first one drawn on the image: the header's
    assert (header > 0) == vqa

    def embeddings(img):
        batch = proc(images=[img], text=["what is"] if vqa else None, return_tensors="pt",
                     max_patches=proc.image_processor.max_patches)
        with torch.no_grad():
            return model.encoder.embeddings(batch["flattened_patches"])[0, : rows * cols]

    base = embeddings(image)
    rng = torch.Generator().manual_seed(0)
    checked = 0
    for y, x in zip(torch.randint(0, 74, (200,), generator=rng).tolist(), torch.randint(0, 90, (200,), generator=rng).tolist()):
        region = grid[max(y - 4, 0) : y + 5, max(x - 4, 0) : x + 5]
        if bool((region != grid[y, x]).any()):
            continue
        bumped = image.copy()
        bumped[y, x] = 255 - bumped[y, x]
        change = (embeddings(bumped) - base).abs().sum(-1)
        assert int(change.argmax()) + 1 == int(grid[y, x]), f"pixel {(y, x)}"
        if header > cols:  # the header's rows, a row above the image: (almost) unchanged
            assert float(change[: header - cols].max()) < 0.1 * float(change.max())
        checked += 1
        if checked == 15:
            break
    assert checked >= 10


def test_the_explorer_shows_the_decoders_cross_attention(tmp_path):
    """``vx.explore``: the page's per-word attention is the decoder's cross-attention over the image's patches."""
    import json
    import re

    model, proc = encdec_helpers.pix2struct()
    image = helpers.images(8, ((40, 52),))[0]
    path = vx.explore(model, [image], tmp_path / "p.html", processor=proc, prompt="what is", max_len=3)
    data = json.loads(re.search(r'<script type="application/json" id="vx-data">(.*?)</script>', path.read_text(), re.S).group(1))
    vlm = data["images"][0]["vlm"]
    assert vlm["attention"]["layers"] == [f"decoder.layer.{i}.encoder_decoder_attention.attention" for i in range(2)]
    assert vlm["tokens"] == 20 and vlm["pieces"][0]["grid"] == [4, 5] and len(vlm["words"]) >= 1


@pytest.mark.parametrize("name", list(encdec_helpers.BUILDERS))
def test_the_caption_command_takes_a_saved_folder(name, tmp_path):
    """``vitexplain caption --model DIR --prompt ...`` on a ``save_pretrained`` folder (model + processor), offline."""
    from PIL import Image

    from vitexplain import cli

    model, proc = encdec_helpers.BUILDERS[name]()
    model.save_pretrained(tmp_path / "model")
    proc.save_pretrained(tmp_path / "model")
    (tmp_path / "in").mkdir()
    Image.fromarray(helpers.images(9, ((40, 52),))[0]).save(tmp_path / "in" / "a.png")
    rc = cli.main(["caption", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--model", str(tmp_path / "model"),
                   "--prompt", "what is", "--method", "cross", "--max-len", "3", "-j", "0"])
    assert rc == 0
    with np.load(tmp_path / "out" / "a.png.cross.npz") as saved:
        assert saved["maps"].shape[1:] == (40, 52) and len(saved["tokens"]) == saved["maps"].shape[0]  # per word, own size


def test_a_forced_first_token_is_part_of_the_decoder_prefix():
    """BART-style generation configs force ``<s>`` after the decoder start token: that token is no answer word;
    the explained words are what ``generate`` gives after it."""
    model, proc = encdec_helpers.florence2()
    model.generation_config.forced_bos_token_id = proc.tokenizer.bos_token_id
    image = helpers.images(4)[0]
    e = vx.Explainer(model, processor=proc).explain_caption([image], prompt="what is", max_len=4)
    batch = proc(images=[image], text=["what is"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=5, do_sample=False, suppress_tokens=[model.config.image_token_id])[0]
    assert out[:2].tolist() == [model.config.get_text_config(decoder=True).decoder_start_token_id, proc.tokenizer.bos_token_id]
    words = out[2:].tolist()
    words = words[: words.index(proc.tokenizer.eos_token_id)] if proc.tokenizer.eos_token_id in words else words
    assert words and e.ids[0, : len(words)].tolist() == words


def test_cross_heads_and_layers_index_the_decoders_cross_attention():
    """``cross`` options on an encoder-decoder: ``layers`` and ``heads=[(layer, head)]`` pick decoder cross-attention
    layers and heads (eager oracle)."""
    model, proc = encdec_helpers.florence2()
    images = helpers.images(10)
    answers = _ids(proc, ANSWERS)
    kwargs, start, ids, columns = _oracle_inputs("florence2", model, proc, images, PROMPTS, answers)
    with torch.no_grad():
        atts = helpers.eager_copy(model)(**kwargs, output_attentions=True, use_cache=False).cross_attentions
    rows = slice(start - 1, start - 1 + ids.shape[1])
    ex = vx.Explainer(model, processor=proc)
    cases = {"heads": (dict(heads=[(0, 1), (-1, 0)]), (atts[0][:, 1, rows] + atts[1][:, 0, rows]) / 2),
             "last layer, max": (dict(layers=-1, head_fusion="max"), atts[1][:, :, rows].amax(1))}
    for label, (options, want) in cases.items():
        e = ex.explain_caption(images, method="cross", caption=answers, prompt=PROMPTS, **options)
        for b, cols in enumerate(columns):
            expected = want[b][:, cols].clone()
            expected[len(answers[b]):] = 0
            torch.testing.assert_close(e.token_scores[b], expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"{label}: {m}")
    with pytest.raises(vx.OptionError, match="layers"):
        ex.explain_caption(images, method="cross", caption=answers, prompt=PROMPTS, layers=2)
