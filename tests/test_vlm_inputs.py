"""What a vision-language model is given: images of any shape reach its processor as the user's pixels.

Tiny random-init builds (``tests/vlm_helpers.py``, ``tests/encdec_helpers.py``), one per way the
processor is called (LLaVA: the base adapter's batch; Idefics3: its tile count too; Pix2Struct: the
encoder-decoder batch). The expectation is the eager oracle of the family's checks fed PIL images,
whose layout a processor cannot misread.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import vitexplain as vx
import encdec_helpers
import test_vlm_encdec
import vlm_checks
import vlm_helpers as helpers

ANSWERS = [["red", "circle"]]


@pytest.mark.parametrize("name", ["llava", "idefics3", "pix2struct"])
@pytest.mark.parametrize("size", [(3, 45), (1, 37), (4, 3)])
def test_an_image_one_or_three_pixels_thin_is_not_read_as_channels_first(name, size):
    """transformers guesses channels-first for some arrays with a side of 1 or 3 pixels;
    the maps of such an array equal the oracle's on the same pixels given as a PIL image."""
    torch.manual_seed(0)
    builders = {**helpers.BUILDERS, **encdec_helpers.BUILDERS}
    model, proc = builders[name]()
    image = helpers.images(11, (size,))[0]
    answers = [[proc.tokenizer.convert_tokens_to_ids(w) for w in ws] for ws in ANSWERS]
    got = vx.Explainer(model, processor=proc).explain_caption([image], method="cross", caption=answers, prompt="what is")
    checks = test_vlm_encdec if name in encdec_helpers.BUILDERS else vlm_checks
    want = checks.oracle(name, model, proc, [Image.fromarray(image)], ["what is"], answers)["cross"]
    torch.testing.assert_close(got.token_scores[0], want[0], atol=1e-5, rtol=1e-4)
    assert got.image_maps[0].shape == (len(ANSWERS[0]), *size)
    assert bool(torch.isfinite(got.image_maps[0]).all())


@pytest.fixture(scope="module")
def llava():
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS["llava"]()
    return vx.Explainer(model, processor=proc)


@pytest.mark.parametrize("images, kwargs, error, match", [
    (np.zeros((0, 5, 3), np.uint8), {}, vx.UsageError, "empty"),
    ([helpers.images(1)[0], np.zeros((4, 0, 3), np.uint8)], {}, vx.UsageError, "each image is empty"),
    (Image.new("RGB", (7, 0)), {}, vx.UsageError, "empty"),
    (None, {"prompt": 5}, vx.UsageError, "prompt must be a string or a list"),
    (None, {"caption": 7}, vx.UsageError, "caption must be a string or a list"),
])
def test_bad_inputs_are_vitexplain_errors(llava, images, kwargs, error, match):
    """An empty image or a prompt that is neither text nor a list: a UsageError naming it, not the
    processor's ZeroDivisionError or a TypeError from deep inside."""
    images = helpers.images(2)[0] if images is None else images
    with pytest.raises(error, match=match):
        llava.explain_caption(images, **kwargs)


@pytest.mark.parametrize("name", ["blip2", "florence2"])
def test_an_image_token_in_a_prompt_the_processor_prefixes_is_refused(name):
    """BLIP-2 and Florence-2's processors put the image tokens in front of the prompt themselves: an
    ``<image>`` of the user's would be one image token too many (BLIP-2's forward failed in masked_scatter)."""
    torch.manual_seed(0)
    model, proc = {**helpers.BUILDERS, **encdec_helpers.BUILDERS}[name]()
    ex = vx.Explainer(model, processor=proc)
    with pytest.raises(vx.InputError, match="puts in front of every prompt itself; remove it"):
        ex.explain_caption(helpers.images(3)[:1], prompt="<image> what is", max_len=2)
    e = ex.explain_caption(helpers.images(3)[:1], prompt="what is", max_len=2)  # without it: explained
    assert bool(torch.isfinite(e.maps).all())


@pytest.mark.parametrize("name", ["llava_next", "onevision"])
def test_a_wide_image_whose_tiles_unpad_to_no_row(name):
    """A 20 x 300 image: the model's unpadding keeps no row of the stitched tiles (0 tile tokens, the
    thumbnail's only); the maps are the thumbnail's, equal to the oracle's, on the pixels that change its tokens."""
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS[name]()
    image = helpers.images(12, ((20, 300),))[0]
    ex = vx.Explainer(model, processor=proc)
    view = ex.adapter.views([image], ex.adapter.prepare([image], ["what is"]))[0]
    assert [p.num_tokens for p in view.pieces if p.name == "tiles"] == [0]  # the case this test is about
    answers = [[proc.tokenizer.convert_tokens_to_ids(w) for w in ws] for ws in ANSWERS]
    got = ex.explain_caption([image], method="cross", caption=answers, prompt="what is")
    want = vlm_checks.oracle(name, model, proc, [Image.fromarray(image)], ["what is"], answers)["cross"]
    torch.testing.assert_close(got.token_scores[0], want[0], atol=1e-5, rtol=1e-4)
    assert got.image_maps[0].shape == (2, 20, 300) and float(got.image_maps[0].abs().min()) > 0  # the thumbnail covers it all
    vlm_checks.check_footprints((name, model, proc), (20, 300))


@pytest.mark.parametrize("name", ["blip2", "instructblip"])
def test_an_empty_prompt_in_a_batch_of_a_query_token_model(name):
    """BLIP-2's and InstructBLIP's processors put the query tokens in front of the left-padded prompt: an
    empty prompt (this tokenizer adds no BOS) beside a longer one ended in padding, and the pad's row
    predicted answer word 0. In a batch it now equals the image alone, generated answer and maps."""
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS[name]()
    ex = vx.Explainer(model, processor=proc)
    images = helpers.images(13)
    prompts = ["what is", ""]
    answers = [[proc.tokenizer.convert_tokens_to_ids(w) for w in ws] for ws in [["red", "circle"], ["blue", "square"]]]
    for caption in (answers, None):
        together = ex.explain_caption(images, method=["cross", "cross_generic"], caption=caption, prompt=prompts, max_len=3)
        alone = ex.explain_caption(images[1:], method=["cross", "cross_generic"], prompt="", max_len=3,
                                   caption=None if caption is None else caption[1:])
        for e_all, e_one in zip(together, alone):
            n = len(e_one.tokens[0])
            assert e_all.ids[1, :n].tolist() == e_one.ids[0, :n].tolist()
            torch.testing.assert_close(e_all.token_scores[1][:n], e_one.token_scores[0][:n], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(e_all.image_maps[1][:n], e_one.image_maps[0][:n], atol=1e-5, rtol=1e-4)


def test_a_prompt_ending_in_padding_is_refused(llava):
    """The rows that predict the answer are the same for every prompt only when no prompt ends in padding."""
    inputs = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    with pytest.raises(vx.UnsupportedModelError, match=r"prompt\(s\) \[1\] at the end"):
        llava.adapter.answer_start(inputs)


def test_a_given_answer_word_the_tokenizer_does_not_know_is_refused(llava):
    """A word-level tokenizer makes an unknown word its <unk> token, a word the user did not ask about:
    refused through the API as the caption command refuses it (it explained '<unk>' instead)."""
    image = helpers.images(14)[:1]
    with pytest.raises(vx.UsageError, match=r"does not know \['zebra'\]"):
        llava.explain_caption(image, caption="red zebra", prompt="what is")
    with pytest.raises(vx.UsageError, match=r"does not know \['zebra'\]"):
        llava.explain_caption(image * 2, caption=["red", "zebra"], prompt="what is")
    assert llava.explain_caption(image, caption="red circle", prompt="what is").tokens == [["red", "circle"]]


def test_prompts_and_answers_longer_than_learned_positions():
    """Florence-2's BART has a learned table of 64 positions here (encoder and decoder): a sequence one
    longer raised a raw IndexError. Now an encoder input of exactly 64 tokens and a decoder of 64
    (start token + 63 words) are explained, one more is a vitexplain error, and generation stops there."""
    torch.manual_seed(0)
    model, proc = encdec_helpers.BUILDERS["florence2"]()
    ex = vx.Explainer(model, processor=proc)
    image = helpers.images(15)[:1]
    assert ex.adapter.position_limit() == model.config.text_config.max_position_embeddings == 64
    words = 64 - 17 - 2  # the encoder reads 17 image tokens, <s>, the prompt, </s>
    e = ex.explain_caption(image, prompt=" ".join(["what"] * words), caption="red")
    assert bool(torch.isfinite(e.maps).all())
    with pytest.raises(vx.InputError, match="65 positions .* 64 learned positions"):
        ex.explain_caption(image, prompt=" ".join(["what"] * (words + 1)), caption="red")
    assert len(ex.explain_caption(image, prompt="what", caption=" ".join(["red"] * 63)).tokens[0]) == 63
    with pytest.raises(vx.UsageError, match="64 tokens, but after this prompt the model has positions for 63"):
        ex.explain_caption(image, prompt="what", caption=" ".join(["red"] * 64))
    assert len(ex.explain_caption(image, prompt="what", max_len=500).tokens[0]) <= 63


@pytest.mark.parametrize("name, settings", [("llava", {"size": {"shortest_edge": 40}}),
                                            ("idefics3", {"do_image_splitting": False})])
def test_processor_kwargs_that_change_the_token_geometry(name, settings):
    """``processor_kwargs`` override the image processor's settings in every processor call; the token
    geometry followed the processor's own attributes instead (LLaVA: the crop of a 40 px resize mapped as
    that of a 32 px one, silently; Idefics3 without splitting: refused as a processor mismatch). The maps
    equal those of a processor built with these settings, whose geometry the footprint probe checks."""
    import copy

    torch.manual_seed(0)
    model, proc = helpers.BUILDERS[name]()
    image = helpers.images(16, ((40, 90),))
    answers = [[proc.tokenizer.convert_tokens_to_ids(w) for w in ws] for ws in ANSWERS]
    before = copy.deepcopy(proc.image_processor.to_dict())
    given = vx.Explainer(model, processor=proc, processor_kwargs=settings).explain_caption(
        image, method="cross", caption=answers, prompt="what is")
    assert proc.image_processor.to_dict() == before  # the user's processor is left as found
    built = copy.deepcopy(proc)
    for key, value in settings.items():
        setattr(built.image_processor, key, value)
    vlm_checks.check_footprints((name, model, built), (40, 90))
    want = vx.Explainer(model, processor=built).explain_caption(image, method="cross", caption=answers, prompt="what is")
    torch.testing.assert_close(given.image_maps[0], want.image_maps[0], atol=1e-6, rtol=1e-5)


def test_pix2struct_takes_processor_kwargs():
    """Pix2Struct's batch ignored ``processor_kwargs`` (max_patches=48 ran with the processor's 24). Now the
    encoder reads up to 48 patches, and the maps equal those of a processor built with max_patches=48."""
    import copy

    torch.manual_seed(0)
    model, proc = encdec_helpers.BUILDERS["pix2struct"]()
    image = helpers.images(17, ((60, 90),))
    answers = [[proc.tokenizer.convert_tokens_to_ids(w) for w in ws] for ws in ANSWERS]
    given = vx.Explainer(model, processor=proc, processor_kwargs={"max_patches": 48}).explain_caption(
        image, method="cross", caption=answers, prompt="what is")
    built = copy.deepcopy(proc)
    built.image_processor.max_patches = 48
    want = vx.Explainer(model, processor=built).explain_caption(image, method="cross", caption=answers, prompt="what is")
    assert 24 < given.token_scores[0].shape[-1] <= 48 and proc.image_processor.max_patches == 24
    torch.testing.assert_close(given.token_scores[0], want.token_scores[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(given.image_maps[0], want.image_maps[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["florence2", "pix2struct", "mllama"])
def test_gradient_methods_on_a_frozen_model(name):
    """``model.requires_grad_(False)`` (inference code often freezes): a decoder's first self-attention over
    text alone, or Pix2Struct's patches, were in no autograd graph, and cross_grad / cross_generic raised.
    They now equal the unfrozen model's (checked against the eager oracle in the family tests); the model
    stays frozen, keeps no hook and gets no .grad."""
    torch.manual_seed(0)
    model, proc = {**helpers.BUILDERS, **encdec_helpers.BUILDERS}[name]()
    images = helpers.images(18)
    kwargs = dict(method=["cross_grad", "cross_generic"], prompt="what is", caption="red circle")
    want = vx.Explainer(model, processor=proc).explain_caption(images, **kwargs)
    model.requires_grad_(False)
    got = vx.Explainer(model, processor=proc).explain_caption(images, **kwargs)
    for e_got, e_want in zip(got, want):
        for a, b in zip(e_got.token_scores, e_want.token_scores):
            assert float(b.abs().max()) > 0
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not any(p.requires_grad or p.grad is not None for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())


def test_vlm_gradients_run_inside_no_grad_and_are_refused_clearly_inside_inference_mode(llava):
    """cross_grad / cross_generic under the caller's torch.no_grad() equal the maps explained outside it; inside
    torch.inference_mode() a UsageError says to call explain_caption outside it (cross alone runs there)."""
    images = helpers.images(2)
    methods = ["cross", "cross_grad", "cross_generic"]
    want = llava.explain_caption(images, method=methods, prompt="what is", caption="red circle")
    with torch.no_grad():
        got = llava.explain_caption(images, method=methods, prompt="what is", caption="red circle")
    for a, b in zip(got, want):
        torch.testing.assert_close(a.image_maps, b.image_maps)
    with torch.inference_mode(), pytest.raises(vx.UsageError, match=r"cross_grad, cross_generic take\(s\) gradients"):
        llava.explain_caption(images, method=methods, prompt="what is", caption="red circle")
    with torch.inference_mode():
        alone = llava.explain_caption(images, method="cross", prompt="what is", caption="red circle")
    torch.testing.assert_close(alone.image_maps, want[0].image_maps)


@pytest.mark.parametrize("model_name, processor_name", [
    ("llava", "pix2struct"), ("kosmos2", "blip2"), ("pix2struct", "llava"), ("instructblip", "blip2"),
    ("mllama", "onevision"), ("qwen2_vl", "blip2"), ("blip2", "pix2struct"), ("idefics3", "gemma3")])
def test_another_familys_processor_is_a_vitexplain_error(model_name, processor_name):
    """A processor of another family gave bare KeyError / AttributeError / TypeError from the batch, the token
    geometry or the forward (e.g. Pix2Struct given CLIP's: "no attribute 'max_patches'"; InstructBLIP given BLIP-2's:
    forward() missing 'qformer_input_ids'; Idefics3 given Gemma 3's: its tile geometry's return_row_col_info). Each is
    now an UnsupportedModelError saying to pass the model's own processor, before any generation; the model's own
    processor still explains."""
    builders = {**helpers.BUILDERS, **encdec_helpers.BUILDERS}
    model, own = builders[model_name]()
    _, other = builders[processor_name]()
    images = helpers.images(20, ((40, 60), (50, 30)))
    for caption in ("red", None):
        with pytest.raises(vx.UnsupportedModelError, match=r"(?s)model's own processor"):
            vx.Explainer(model, processor=other).explain_caption(images, prompt="what is", caption=caption, max_len=2,
                                                                 method=["cross", "cross_generic"])
    assert vx.Explainer(model, processor=own).explain_caption(images, prompt="what is", caption="red").tokens == [["red"]] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pix2struct_in_half_precision(dtype):
    """A Pix2Struct loaded in bfloat16 / float16: its processor's float32 patches reached the patch projection and a bare
    RuntimeError (float != BFloat16) came out (the other families cast their pixels themselves). The patches now take
    the projection's dtype: the maps equal the float32 model's up to half-precision rounding, and row/column ids too
    large for that dtype (past 256 in bfloat16) are an InputError, not silently rounded."""
    torch.manual_seed(0)
    model, proc = encdec_helpers.BUILDERS["pix2struct"]()
    images = helpers.images(21, ((40, 60), (50, 30)))
    kwargs = dict(method=["cross", "cross_generic"], prompt="what is", caption="red circle")
    want = vx.Explainer(model, processor=proc).explain_caption(images, **kwargs)
    half = vx.Explainer(model.to(dtype), processor=proc)
    got = half.explain_caption(images, **kwargs)
    # of the largest value, over 4 seeds: cross <= 1.6% (bf16) / 0.1% (fp16), cross_generic <= 2.8% / 0.2%; about 3x
    for e_got, e_want, tol in zip(got, want, (0.05, 0.08)):
        for a, b in zip(e_got.image_maps, e_want.image_maps):
            assert float((a - b).abs().max()) <= tol * float(b.abs().max())
    wide = np.zeros((2, 300 * 16, 3), dtype=np.uint8)  # 1 x 300 patches of 16 px under max_patches=300
    over = vx.Explainer(model, processor=proc, processor_kwargs={"max_patches": 300})
    if dtype == torch.bfloat16:
        with pytest.raises(vx.InputError, match="bfloat16"):
            over.explain_caption([wide], prompt="what is", caption="red", method="cross")


def test_a_prompt_longer_than_instructblips_qformer_positions_is_refused():
    """InstructBLIP's Q-Former reads the prompt too, with its own table of learned positions (512 here, as the real
    ones): a longer prompt raised a bare RuntimeError (size 520 vs 512) from its embeddings, though the language
    model has room (2048). Now it is an InputError naming the Q-Former's limit; a prompt that fits still explains."""
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS["instructblip"]()
    limit = model.config.qformer_config.max_position_embeddings
    image = helpers.images(23)[:1]
    ex = vx.Explainer(model, processor=proc)
    fits = " ".join(["what"] * (limit - 12))
    assert ex.explain_caption(image, prompt=fits, caption="red", method="cross").tokens == [["red"]]
    with pytest.raises(vx.InputError, match=f"Q-Former.*{limit} learned positions"):
        ex.explain_caption(image, prompt=" ".join(["what"] * (limit + 8)), caption="red", method="cross")


@pytest.mark.parametrize("name", ["llava_next", "onevision"])
def test_tile_pinpoints_other_than_the_models_are_refused(name):
    """LLaVA-NeXT / OneVision cut the image into tiles by the image processor's ``image_grid_pinpoints`` but stitch them
    back by the model config's. Given other pinpoints (here through processor_kwargs) a bare RuntimeError
    (split_with_sizes) came out of the model's forward; now an UnsupportedModelError names both, before generation."""
    model, proc = helpers.BUILDERS[name]()
    image = helpers.images(24, ((45, 70),))
    other = vx.Explainer(model, processor=proc, processor_kwargs={"image_grid_pinpoints": [[16, 16]]})
    for caption in ("red", None):
        with pytest.raises(vx.UnsupportedModelError, match=r"image_grid_pinpoints \[\[16, 16\]\].*model's"):
            other.explain_caption(image, prompt="what is", caption=caption, method="cross", max_len=2)


@pytest.mark.parametrize("name, settings", [
    ("llava", {"crop_size": {"height": 24, "width": 24}}), ("gemma3", {"size": {"height": 48, "width": 48}}),
    ("blip2", {"size": {"height": 48, "width": 48}}), ("mllama", {"max_image_tiles": 2}),
    ("qwen2_vl", {"patch_size": 8}), ("qwen2_vl", {"merge_size": 1}), ("onevision", {"size": {"height": 32, "width": 32}}),
    ("idefics3", {"max_image_size": {"longest_edge": 32}}), ("florence2", {"size": {"height": 48, "width": 48}})])
def test_processor_settings_the_model_cannot_read_are_a_vitexplain_error(name, settings):
    """processor_kwargs (or a processor of another checkpoint) that change the image size, tiles or image tokens so
    that the model cannot read them: the model's forward or generate raised a bare ValueError / RuntimeError ("Input
    image size (24*24) doesn't match model (32*32)", "The size of tensor a (144) must match ..."), or, with a given
    answer, the token count was refused only after generation. Now each is an UnsupportedModelError that says to use
    the model's own processor settings and carries the model's message; generated or given answer alike."""
    model, proc = {**helpers.BUILDERS, **encdec_helpers.BUILDERS}[name]()
    images = helpers.images(25, ((45, 70), (30, 30)))
    ex = vx.Explainer(model, processor=proc, processor_kwargs=settings)
    for caption in ("red", None):
        with pytest.raises(vx.UnsupportedModelError, match=r"(?s)processor"):
            ex.explain_caption(images, prompt="what is", caption=caption, method=["cross", "cross_generic"], max_len=2)


@pytest.mark.parametrize("name, sizes", [("idefics2", ((1, 1),)), ("lfm2_vl", ((200, 3), (40, 40))), ("gemma4", ((3, 200),))])
def test_an_image_the_processor_or_the_model_cannot_take_is_a_vitexplain_error(name, sizes):
    """A 1 x 1 image in Idefics2's processor (ZeroDivisionError), a 200 x 3 one batched with another in LFM2-VL's
    (RuntimeError from its own stacking), a 3 x 200 one in Gemma 4's vision tower (IndexError: its position table):
    each came out bare. The processor's are an InputError (check the image), the model's an UnsupportedModelError;
    both carry the original message."""
    model, proc = helpers.BUILDERS[name]()
    images = helpers.images(26, sizes)
    for caption in ("red", None):
        with pytest.raises((vx.InputError, vx.UnsupportedModelError)) as info:
            vx.Explainer(model, processor=proc).explain_caption(images, prompt="what is", caption=caption, max_len=2)
        assert "image" in str(info.value) and info.value.__cause__ is not None
