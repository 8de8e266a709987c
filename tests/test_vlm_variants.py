"""Vision-language models and captioners in settings the family checks do not use: a checkpoint's own generation
config, a tokenizer without a pad token, ... (tiny random-init builds of tests/vlm_helpers.py; each case runs in
about a second on one core).

Each test compares the explanation in the variant with the same model's explanation in the plain setting, or with
the model's own ``generate``: an independent expectation, not a property of the code under test.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import vitexplain as vx

transformers = pytest.importorskip("transformers")
import vlm_helpers as helpers  # noqa: E402

PROMPTS = ["what is", "what color is the shape on the left"]
FAMILIES = ["llava", "qwen2_vl", "paligemma", "smolvlm", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def built(request):
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS[request.param]()
    return request.param, model, proc


def _plain(model, proc, images, **kwargs):
    return vx.Explainer(model, processor=proc).explain_caption(images, method="cross", prompt=PROMPTS, max_len=3, **kwargs)


def _same(got, want):
    assert got.tokens == want.tokens
    assert torch.equal(got.ids, want.ids)
    for a, b in zip(got.token_scores, want.token_scores):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("setting", [dict(return_dict_in_generate=True, output_scores=True),
                                     dict(return_dict_in_generate=True, output_attentions=True, output_hidden_states=True),
                                     dict(return_dict_in_generate=True, output_logits=True),
                                     dict(num_return_sequences=2, num_beams=2)])
def test_a_generation_config_that_returns_a_dict_still_gives_the_answer(built, setting):
    """A checkpoint's generation_config may ask ``generate`` for a ``GenerateOutput`` (scores, attentions): the answer
    was sliced as if it were the ids tensor, a TypeError ("tuple indices must be integers") out of explain_caption.
    One asking for several sequences per input was refused as a model that "cannot read an image size" (greedy search
    takes one). Now the answer and the maps are those of the plain config, and the user's config is left as set."""
    name, model, proc = built
    images = helpers.images(0)
    want = _plain(model, proc, images)
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    try:
        for key, value in setting.items():
            setattr(model.generation_config, key, value)
        before = model.generation_config.to_json_string()
        got = _plain(model, proc, images)
        assert model.generation_config.to_json_string() == before
    finally:
        model.generation_config = saved
    _same(got, want)


def test_a_tokenizer_without_a_pad_token_is_padded_with_another_token(built):
    """Llama-style tokenizers have no pad token: the processor's ``padding=True`` refused even one prompt ("Asking to
    pad but the tokenizer does not have a padding token") and explain_caption raised an InputError about the image and
    the prompt. The padding is masked out, so any token serves: the explanation equals the one with a pad token (a
    batch of prompts of different lengths, and one prompt), and the tokenizer is left without one."""
    name, model, proc = built
    images = helpers.images(1)
    want = _plain(model, proc, images)
    want_one = vx.Explainer(model, processor=proc).explain_caption(images[:1], method="cross", prompt=PROMPTS[0], max_len=3)
    tok = copy.deepcopy(proc.tokenizer)
    tok.pad_token = None
    no_pad = copy.copy(proc)
    no_pad.tokenizer = tok
    got = _plain(model, no_pad, images)
    got_one = vx.Explainer(model, processor=no_pad).explain_caption(images[:1], method="cross", prompt=PROMPTS[0], max_len=3)
    assert tok.pad_token is None and tok.pad_token_id is None
    _same(got, want)
    _same(got_one, want_one)


def _vit_gpt2():
    enc = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 image_size=32, patch_size=8)
    dec = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=40, n_positions=32, add_cross_attention=True,
                                  is_decoder=True, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id = 0, 1, 1
    torch.manual_seed(0)
    return transformers.VisionEncoderDecoderModel(config=cfg).eval()


def _git():
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    cfg = transformers.GitConfig(vision_config=vision, vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GitForCausalLM(cfg).eval()


def test_a_generation_config_with_stop_strings_is_refused_saying_what_to_do(built):
    """A checkpoint's ``stop_strings`` end an answer on a string, which ``generate`` applies only with a tokenizer:
    it raised a ValueError that came out as "cannot read an image size". Now a refusal naming the setting; a given
    answer is explained, and with the setting cleared the explanation is the plain config's."""
    name, model, proc = built
    images = helpers.images(0)
    want = _plain(model, proc, images)
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    try:
        model.generation_config.stop_strings = ["shape"]
        with pytest.raises(vx.UnsupportedModelError, match=r"stop_strings=\['shape'\].*stop_strings = None"):
            _plain(model, proc, images)
        given = vx.Explainer(model, processor=proc).explain_caption(images, method="cross", prompt=PROMPTS,
                                                                     caption="red circle")
        assert len(given.token_scores) == len(images) and all(len(t) > 0 for t in given.tokens)
        model.generation_config.stop_strings = None
        _same(_plain(model, proc, images), want)
    finally:
        model.generation_config = saved


@pytest.mark.parametrize("build", [_vit_gpt2, _git], ids=["vit-gpt2", "git"])
def test_a_captioner_whose_generation_config_returns_a_dict_still_captions(build):
    """The same for Hugging Face captioners (VisionEncoderDecoder, GIT): their ``generate`` output was sliced as ids."""
    model = build()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    want = vx.Explainer(model).explain_caption(x, method="cross", max_len=3)
    model.generation_config.return_dict_in_generate = True
    model.generation_config.output_scores = True
    got = vx.Explainer(model).explain_caption(x, method="cross", max_len=3)
    assert model.generation_config.return_dict_in_generate and model.generation_config.output_scores
    assert got.tokens == want.tokens
    torch.testing.assert_close(got.maps, want.maps, atol=1e-6, rtol=1e-5)


def _llava_next(tower: str, strategy: str):
    """:func:`vlm_helpers.llava_next` with a CLIP or a SigLIP tower and either feature strategy."""
    tok = helpers.tokenizer(("<image>",))
    pinpoints = [[16, 32], [32, 16], [32, 32]]
    image = transformers.LlavaNextImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                                 image_grid_pinpoints=pinpoints)
    proc = transformers.LlavaNextProcessor(image_processor=image, tokenizer=tok, patch_size=4,
                                           vision_feature_select_strategy=strategy,
                                           num_additional_image_tokens=1 if tower == "clip" else 0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4)
    vision = transformers.CLIPVisionConfig(**small) if tower == "clip" else transformers.SiglipVisionConfig(**small)
    cfg = transformers.LlavaNextConfig(vision_config=vision, text_config=dict(model_type="llama", vocab_size=len(tok), **helpers._text()),
                                       image_token_id=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=pinpoints,
                                       vision_feature_select_strategy=strategy, vision_feature_layer=-1)
    return helpers._sdpa_built(transformers.LlavaNextForConditionalGeneration, cfg, proc)


def test_llava_next_with_a_siglip_tower_and_the_full_strategy_is_explained():
    """LLaVA-NeXT with a SigLIP tower (no class token) and the "full" strategy keeps each tile's 4 x 4 patches, as CLIP
    with "default" does (and LLaVA-OneVision, SigLIP with "full"): the adapter refused every "full" model as "a class
    token per tile". Now the maps equal the eager oracle of tests/vlm_checks.py, and each token covers the pixels that
    change it (footprint probe); CLIP with "full" (a class token per tile, which the model cannot stitch) is still refused."""
    import vlm_checks

    model, proc = _llava_next("siglip", "full")
    images = helpers.images(2)
    answers = [[proc.tokenizer.convert_tokens_to_ids(w) for w in words] for words in vlm_checks.ANSWERS]
    got = vx.Explainer(model, processor=proc).explain_caption(images, method=["cross", "cross_generic"], caption=answers,
                                                              prompt=vlm_checks.PROMPTS)
    want = vlm_checks.oracle("llava_next", model, proc, images, vlm_checks.PROMPTS, answers)
    for e in got:
        for a, b in zip(e.token_scores, want[e.method]):
            assert float(b.abs().max()) > 0
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    vlm_checks.check_footprints(("llava_next", model, proc), (20, 90))
    model, proc = _llava_next("clip", "full")
    with pytest.raises(vx.UnsupportedModelError, match="'full' feature strategy on a vision tower with a class token"):
        vx.Explainer(model, processor=proc).explain_caption(images, method="cross", prompt="what is", max_len=2)


def test_layers_whose_sliding_window_has_passed_the_image_are_refused():
    """Gemma 3's sliding-window layers (window 8 here) give an answer row no attention to image tokens more than 8
    positions back: ``cross`` / ``cross_grad`` over such a layer alone returned maps of 0 everywhere, silently. Now they
    raise an OptionError that names the layers and what to choose; the full-attention layer, and all layers (the
    default), still give maps that are not constant."""
    model, proc = helpers.gemma3()
    text = model.config.text_config
    sliding = text.layer_types.index("sliding_attention")
    full = text.layer_types.index("full_attention")
    images = helpers.images(3, ((40, 52),))
    prompt = "what color is the shape on the left of the square"
    ex = vx.Explainer(model, processor=proc)
    inputs = ex.adapter.prepare(images, [prompt])
    last_image = int((inputs["input_ids"][0] == model.config.image_token_id).nonzero().max())
    assert inputs["input_ids"].shape[1] - 1 - last_image >= text.sliding_window  # the window has passed the image
    for method, layers in [("cross", sliding), ("cross", [sliding]), ("cross_grad", sliding)]:
        with pytest.raises(vx.OptionError, match=re.escape(f"layers={layers!r} gives answer word(s) [0, 1] of image 0 no weight")):
            ex.explain_caption(images, method=method, prompt=prompt, caption="red circle", layers=layers)
    for layers in (full, None):
        for e in ex.explain_caption(images, method=["cross", "cross_grad"], prompt=prompt, caption="red circle",
                                    cross={"layers": layers}, cross_grad={"layers": layers}):
            for word in e.image_maps[0]:
                assert torch.isfinite(word).all() and float(word.max() - word.min()) > 0


def test_several_images_for_one_prompt_are_refused_clearly():
    """explain_caption explains one image per prompt. A list of images for one prompt ([[a, b]], as processors take
    them) of different sizes was a bare NumPy ValueError ("inhomogeneous shape"); it is an InputError that says so.
    A decoder-only VLM's ``generate`` output holds the prompt (image tokens) before the answer: passed as ``caption=``,
    the refusal now says to pass only the answer."""
    model, proc = helpers.llava()
    a, b = helpers.images(4)
    ex = vx.Explainer(model, processor=proc)
    for images in ([[a, b]], [(a, b)], [a, [b, a]]):
        with pytest.raises(vx.InputError, match="one image per prompt"):
            ex.explain_caption(images, method="cross", prompt="<image> <image> what", max_len=2)
    batch = ex.adapter.prepare([a], ["what is"])
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    with pytest.raises(vx.UsageError, match=re.escape("pass only the answer, out[:, prompt_length:]")):
        ex.explain_caption([a], method="cross", prompt="what is", caption=out)
    e = ex.explain_caption([a], method="cross", prompt="what is", caption=out[:, batch["input_ids"].shape[1]:])
    assert e.ids[0].tolist() == out[0, batch["input_ids"].shape[1]:].tolist()


def test_a_prompt_holding_the_models_own_image_token_is_refused_as_such():
    """Gemma 3's processor writes the image as ``<start_of_image>`` and expands it into ``<image_soft_token>``s. A
    prompt that holds ``<image_soft_token>`` itself gives the sequence one image token more than the image has
    features (17 for 16, counted here from the processor's own batch): the refusal blamed the processor ("the
    processor and the model disagree (pass the model's own processor)"); it now names the prompt and the placeholder.
    Families whose placeholder is the image token itself (LLaVA's ``<image>``) keep the processor's own check."""
    model, proc = helpers.gemma3()
    images = helpers.images(5, ((40, 52),))
    soft = proc.tokenizer.convert_ids_to_tokens(model.config.image_token_id)
    batch = proc(images=images, text=[f"<start_of_image>{soft} what"], return_tensors="pt")
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == model.config.mm_tokens_per_image + 1
    ex = vx.Explainer(model, processor=proc)
    with pytest.raises(vx.InputError, match=re.escape(f"holds '{soft}'") + ".*write the image as '<start_of_image>'"):
        ex.explain_caption(images, method="cross", prompt=f"{soft} what", max_len=2)
    e = ex.explain_caption(images, method="cross", prompt="<start_of_image> what", max_len=2)
    assert e.token_scores[0].shape[-1] == model.config.mm_tokens_per_image


@pytest.mark.parametrize("size, box", [((20, 90), (-35.0, 0.0, 55.0, 90.0)), ((90, 21), (0.0, -34.0, 90.0, 56.0))])
def test_llava_whose_processor_pads_to_a_square_maps_the_whole_image(size, box):
    """LLaVA's own image processor (``LlavaImageProcessor``, ``do_pad=True``: the original LLaVA-1.5 "pad to square")
    pads the image, centred, to a square before resizing and cropping it, so the whole image is seen. The geometry
    followed the resize and crop alone, as if the long sides were cropped away: each token's pixels were misplaced, the
    borders got no token. By hand: a 20 x 90 image is padded to 90 x 90 (35 rows above, 35 below), which the 32 px
    resize and crop keep whole; so the 4 x 4 grid spans rows -35..55 and columns 0..90 (21 x 90: 34 columns on the
    left, 35 on the right). The footprint probe of tests/vlm_checks.py agrees (pixels change the tokens drawn there)."""
    import vlm_checks

    model, proc = helpers.llava()
    proc.image_processor = transformers.LlavaImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                            do_pad=True)
    image = helpers.images(6, (size,))[0]
    adapter = vx.Explainer(model, processor=proc).adapter
    (piece,) = adapter.views([image], adapter.prepare([image], [""]))[0].pieces
    assert piece.grid == (4, 4)
    assert piece.box == pytest.approx(box)
    vlm_checks.check_footprints(("llava", model, proc), size)


@pytest.mark.parametrize("build", [_vit_gpt2, _git], ids=["vit-gpt2", "git"])
def test_a_captioner_whose_generation_config_has_stop_strings_is_refused(build):
    """The same refusal for Hugging Face captioners (their generate raised the tokenizer ValueError bare)."""
    model = build()
    model.generation_config.stop_strings = ["."]
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with pytest.raises(vx.UnsupportedModelError, match=r"stop_strings=\['\.'\]"):
        vx.Explainer(model).explain_caption(x, method="cross", max_len=3)
