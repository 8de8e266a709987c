"""The checks every supported vision-language family passes (imported by tests/test_vlm_*.py, one file per group).

For each supported family (tiny random-init builds, ``tests/vlm_helpers.py``): the image changes the
logits (else a map means nothing); ``cross``, ``cross_grad`` and ``cross_generic`` on the model's SDPA
equal the same definitions computed here, independently, from an eager copy's
``output_attentions`` and ``torch.autograd.grad`` (1e-5); a left-padded batch of 2 equals each image
alone; the default answer is the model's own greedy ``generate``; and each image token's pixels (the
adapter's geometry, rendered at the original resolution) are the pixels that change that token,
probed by perturbing single original pixels with the vision tower's attention switched off (out
projections zeroed on a copy, so each token sees only its own patch).
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
import vlm_helpers as helpers

__all__ = ["test_the_image_changes_the_logits", "test_methods_equal_the_eager_oracle",
           "test_a_padded_batch_equals_each_image_alone", "test_the_default_answer_is_the_models_greedy_generation",
           "test_each_token_covers_the_pixels_that_change_it", "family"]
METHODS = ("cross", "cross_grad", "cross_generic")
PROMPTS = ["what is", "what color is the shape"]
ANSWERS = [["red", "circle", "on", "the"], ["blue", "square"]]


def family(names):
    """The module-scoped ``built`` fixture of a test file: (name, model, processor) for each family in ``names``."""

    @pytest.fixture(scope="module", params=list(names))
    def built(request):
        torch.manual_seed(0)
        model, proc = helpers.BUILDERS[request.param]()
        return request.param, model, proc

    return built


def _methods(name):
    """The methods a family supports: all of :data:`METHODS` unless its oracle entry names fewer."""
    return list(helpers.ORACLE[name].get("methods", METHODS))


def _answer_ids(proc, answers):
    return [[proc.tokenizer.convert_tokens_to_ids(w) for w in words] for words in answers]


def _oracle_inputs(name, model, proc, images, prompts, answers):
    """The teacher-forced inputs, built here from the processor (left padding) and the answer ids."""
    spec = helpers.ORACLE[name]
    texts = [spec["prompt"](p) for p in prompts]
    given = [[image] for image in images] if spec.get("nested") else images
    side, proc.tokenizer.padding_side = proc.tokenizer.padding_side, "left"  # (Kosmos-2's processor reads the attribute)
    try:
        batch = proc(images=given, text=texts, padding=True, padding_side="left", return_tensors="pt")
    finally:
        proc.tokenizer.padding_side = side
    if "qformer_input_ids" in batch:  # InstructBLIP's Q-Former text: positions 0, 1, ... from its first column, so a
        # shorter prompt is padded on the right (as it is alone); left padding would shift its positions
        qformer = proc.qformer_tokenizer(texts, padding=True, padding_side="right", return_tensors="pt")
        batch["qformer_input_ids"], batch["qformer_attention_mask"] = qformer["input_ids"], qformer["attention_mask"]
    pad = proc.tokenizer.pad_token_id
    t = max(len(a) for a in answers)
    ids = torch.tensor([a + [pad] * (t - len(a)) for a in answers])
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    kwargs["input_ids"] = torch.cat([batch["input_ids"], ids], 1)
    kwargs["attention_mask"] = torch.cat([batch["attention_mask"], torch.ones_like(ids)], 1)
    spec["extend"](kwargs, batch, ids)
    if "columns" in spec:
        columns = spec["columns"](batch)
    else:
        columns = [row.nonzero()[:, 0] for row in batch["input_ids"] == spec["image_token"](model)]
    if "pixel_tokens" in spec:  # which image tokens carry pixels (LLaVA-NeXT: not the row newlines)
        columns = [cols[keep] for cols, keep in zip(columns, spec["pixel_tokens"](model, batch))]
    return kwargs, batch["input_ids"].shape[1], ids, columns


def oracle(name, model, proc, images, prompts, answers):
    """Per method, per image (T, n) scores from an eager copy (definitions in docs/methods.md)."""
    eager = helpers.eager_copy(model)
    kwargs, start, ids, columns = _oracle_inputs(name, model, proc, images, prompts, answers)
    lengths = torch.tensor([len(a) for a in answers])
    t = ids.shape[1]
    spec = helpers.ORACLE[name]
    store, handles = spec["transport"](eager) if "transport" in spec else ([], [])
    try:
        with torch.enable_grad():
            out = eager(**kwargs, output_attentions=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    atts = [a for a in spec.get("lm_attentions", lambda o: o.attentions)(out) if a is not None]
    rows = slice(start - 1, start - 1 + t)
    scores = {"cross": torch.stack([a[:, :, rows].float().mean(1) for a in atts]).mean(0),
              "cross_grad": torch.zeros(ids.shape[0], t, atts[0].shape[-1]),
              "cross_generic": torch.zeros(ids.shape[0], t, atts[0].shape[-1])}
    log_probs = torch.log_softmax(out.logits.float(), -1)
    for word in range(t):
        chosen = log_probs[:, start - 1 + word].gather(1, ids[:, word : word + 1])[:, 0]
        score = (chosen * (lengths > word)).sum()
        grads = torch.autograd.grad(score, atts, retain_graph=True)
        abar = [(a * g).clamp(min=0).mean(1) for a, g in zip(atts, grads)]
        scores["cross_grad"][:, word] = torch.stack([x[:, start - 1 + word] for x in abar]).mean(0)
        r = torch.eye(atts[0].shape[-1]).expand_as(abar[0]).clone()
        for x in abar:
            r = r + x @ r
        scores["cross_generic"][:, word] = r[:, start - 1 + word]
    transport = None  # Q-Former: queries -> patches, the mean cross-attention without the class token's column
    if store and "pieces" not in spec:
        patches = spec.get("patches")  # (Kosmos-2's keys end with its latent queries)
        transport = torch.stack([a.detach().float().mean(1) for a in store]).mean(0)[..., 1 : None if patches is None else 1 + patches]
    result = {}
    for method, value in scores.items():
        per_image = [value[b, :, cols].detach() for b, cols in enumerate(columns)]
        if transport is not None:
            per_image = [p @ transport[b] for b, p in enumerate(per_image)]
        if "pieces" in spec:  # a resampler per piece (Idefics2): each piece's latents -> that piece's patches
            per_image = _through_pieces(store, per_image)
        for b, n in enumerate(lengths.tolist()):
            per_image[b][n:] = 0
        result[method] = per_image
    return result


def _through_pieces(store, per_image):
    """Per image, (T, pieces * L) latent scores -> (T, pieces * P) patch scores through each piece's mean attention over
    layers and heads of its L latents to its P patches (keys: the patches, then the latents)."""
    attention = torch.stack([a.detach().float().mean(1) for a in store]).mean(0)  # (all pieces, L, P + L)
    latents = attention.shape[1]
    out, first = [], 0
    for scores in per_image:
        count = scores.shape[-1] // latents
        out.append(torch.cat([scores[:, k * latents : (k + 1) * latents] @ attention[first + k, :, : -latents]
                              for k in range(count)], dim=-1))
        first += count
    assert first == attention.shape[0]
    return out


def test_the_image_changes_the_logits(built):
    name, model, proc = built
    a, b = helpers.images(1, ((32, 32), (32, 32)))
    a, b = a // 4, 192 + b // 4  # a dark and a bright image
    spec = helpers.ORACLE[name]
    with torch.no_grad():
        logits = [model(**proc(images=[img], text=[spec["prompt"]("what is")], return_tensors="pt")).logits[0, -1]
                  for img in (a, b)]
    assert float((logits[0] - logits[1]).abs().max()) > 1e-3  # a map of an image the model ignores means nothing


def test_methods_equal_the_eager_oracle(built):
    name, model, proc = built
    images = helpers.images(2)
    answers = _answer_ids(proc, ANSWERS)
    explained = vx.Explainer(model, processor=proc).explain_caption(images, method=_methods(name), caption=answers,
                                                                    prompt=PROMPTS)
    expected = oracle(name, model, proc, images, PROMPTS, answers)
    if name != "paligemma2":  # (Gemma 2 has eager attention only)
        assert model.config.text_config._attn_implementation == "sdpa"  # the model kept its fused attention
    adapter = vx.Explainer(model, processor=proc).adapter
    views = adapter.views(images, adapter.prepare(images, PROMPTS))
    for e in explained:
        got_scores = e.token_scores
        if "transport" in helpers.ORACLE[name]:  # Q-Former: compare the maps of the patch scores the queries reach
            got_scores = e.image_maps
            expected[e.method] = [vx.adapters.vlm.render(w, v)[0] for w, v in zip(expected[e.method], views)]
        for got, want in zip(got_scores, expected[e.method]):
            assert got.shape == want.shape
            assert float(want.abs().max()) > 0
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"{e.method}: {m}")
        assert e.tokens == ANSWERS
        for b, image in enumerate(images):
            assert e.image_maps[b].shape == (4, *image.shape[:2])
            back = torch.nn.functional.interpolate(e.maps[b][None], size=image.shape[:2], mode="nearest-exact")[0]
            assert float((back - e.image_maps[b]).abs().gt(1e-6).float().mean()) < 0.1  # lines up with its image


def test_a_padded_batch_equals_each_image_alone(built):
    name, model, proc = built
    images = helpers.images(3)
    ex = vx.Explainer(model, processor=proc)
    together = ex.explain_caption(images, method=_methods(name), prompt=PROMPTS, max_len=4)  # generated answers
    for b, image in enumerate(images):
        alone = ex.explain_caption([image], method=_methods(name), prompt=PROMPTS[b], max_len=4)
        for e_all, e_one in zip(together, alone):
            n = len(e_one.tokens[0])
            assert e_all.ids[b, :n].tolist() == e_one.ids[0, :n].tolist() and e_all.tokens[b] == e_one.tokens[0]
            torch.testing.assert_close(e_all.token_scores[b][:n], e_one.token_scores[0][:n], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(e_all.image_maps[b][:n], e_one.image_maps[0][:n], atol=1e-5, rtol=1e-4)


def test_the_default_answer_is_the_models_greedy_generation(built):
    name, model, proc = built
    images = helpers.images(4)
    spec = helpers.ORACLE[name]  # (a padded batch: each answer is the model's own for its image alone)
    e = vx.Explainer(model, processor=proc).explain_caption(images, prompt=PROMPTS[: len(images)], max_len=5)
    assert e.method == "cross"
    for b, image in enumerate(images):
        batch = proc(images=[image], text=[spec["prompt"](PROMPTS[b])], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=5, do_sample=False, suppress_tokens=spec["placeholders"](model) or None)
        out = out[0, batch["input_ids"].shape[1]:].tolist()
        ends = proc.tokenizer.eos_token_id
        out = out[: out.index(ends)] if ends in out else out
        assert e.ids[b, : len(out)].tolist() == out


def test_each_token_covers_the_pixels_that_change_it(built):
    """Footprint probe: perturb one original pixel at a time (vision attention off) and find, in each token
    grid (the image, or each tile and the thumbnail), the token that changes most; the adapter's rendered
    geometry must put that pixel in that token's cell, and a grid that does not cover the pixel must not change."""
    check_footprints(built, (74, 90))


def check_footprints(built, size):
    """The footprint probe of :func:`test_each_token_covers_the_pixels_that_change_it` on an image of ``size``."""
    name, model, proc = built
    probe = helpers.isolated_tokens(model)
    spec = helpers.ORACLE[name]
    image = helpers.images(6, (size,))[0]
    ex = vx.Explainer(model, processor=proc)
    inputs = ex.adapter.prepare([image], [""])
    view = ex.adapter.views([image], inputs)[0]
    n = view.num_tokens
    _, layers = vx.adapters.vlm.render(torch.arange(1, n + 1, dtype=torch.float64)[None], view)
    base = spec["features"](probe, proc, image)
    assert base.shape[0] == n
    rng = torch.Generator().manual_seed(0)
    ys = torch.randint(0, image.shape[0], (80,), generator=rng).tolist()
    xs = torch.randint(0, image.shape[1], (80,), generator=rng).tolist()
    # near a cell border resampling spreads the change over two tokens: a pixel is checked where every piece's cell
    # around it extends at least 2 px, or a quarter of a cell for pieces of large cells (a thumbnail downscaled a few
    # times: its resampling filter reaches 2 resized pixels, several original ones, into the next cell)
    margins = [max(2, int(min((p.box[2] - p.box[0]) / p.grid[0], (p.box[3] - p.box[1]) / p.grid[1]) / 4))
               if p.num_tokens else 2 for p in view.pieces]  # (a grid unpadded to nothing has no cells)
    checked = 0
    for y, x in zip(ys, xs):
        regions = [layer[0, max(y - m, 0) : y + m + 1, max(x - m, 0) : x + m + 1] for layer, m in zip(layers, margins)]
        if any(bool((r != r.reshape(-1)[0]).any()) for r in regions):
            continue
        if all(int(layer[0, y, x]) == 0 for layer in layers) and any(
                _near(piece.box, y, x, 6) for piece in view.pieces):
            continue  # just outside a crop: a downscaling filter reaches a few pixels in
        bumped = image.copy()
        bumped[y, x] = 255 - bumped[y, x]
        change = (spec["features"](probe, proc, bumped) - base).abs().sum(-1)
        if float(change.max()) == 0.0 and any(int(layer[0, y, x]) for layer in layers):
            continue  # a covered pixel whose flip was rounded away (a large image resized to a few pixels): it tells
            # nothing about where it lies (a pixel no grid covers must change nothing: that is checked below)
        parts = [(piece, change[piece.start : piece.start + piece.num_tokens], int(layer[0, y, x]))
                 for piece, layer in zip(view.pieces, layers) if piece.num_tokens]  # (a grid unpadded to nothing)
        covering = [float(part.max()) for _, part, expected in parts if expected]
        for piece, part, expected in parts:
            if expected:
                assert piece.start + int(part.argmax()) + 1 == expected, f"pixel {(y, x)} in {piece.name}"
            elif covering:  # resampling near a tile edge may leak a little into the next tile: far less
                assert float(part.max()) < 0.5 * min(covering), f"pixel {(y, x)} is outside {piece.name} but changes it"
            else:  # cropped away: changes nothing
                assert float(part.max()) < 1e-6, f"pixel {(y, x)} is outside {piece.name} but changes it"
        checked += 1
        if checked == 12:
            break
    assert checked >= 8


def _near(box, y, x, margin):
    y0, x0, y1, x1 = box
    return y0 - margin <= y + 0.5 <= y1 + margin and x0 - margin <= x + 0.5 <= x1 + margin
