"""Vision-language models whose generation config asks for another KV cache (static, sliding-window, quantized,
offloaded), the generation settings a checkpoint may carry, and a language model of sliding-window layers only
(tiny random-init builds of tests/vlm_helpers.py).

The expectation is independent of the code under test: the model's own greedy ``generate`` with its default cache
(one image alone) for the answer, and the eager-attention oracle of tests/vlm_checks.py (``output_attentions`` of an
eager copy) for the maps.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import vitexplain as vx

transformers = pytest.importorskip("transformers")
import vlm_checks as checks  # noqa: E402
import vlm_helpers as helpers  # noqa: E402

PROMPTS = ["what is", "what color is the shape on the left of the"]
METHODS = ["cross", "cross_generic"]


def _greedy(name, model, proc, images, prompts, steps):
    """Per image alone, the model's greedy answer with a plain generation config (its default dynamic cache), cut at
    the first end token."""
    spec = helpers.ORACLE[name]
    plain = transformers.GenerationConfig(eos_token_id=model.generation_config.eos_token_id,
                                          pad_token_id=model.generation_config.pad_token_id)
    ends = plain.eos_token_id if isinstance(plain.eos_token_id, list) else [plain.eos_token_id]
    answers = []
    for image, prompt in zip(images, prompts):
        batch = proc(images=[[image]] if spec.get("nested") else [image], text=[spec["prompt"](prompt)], return_tensors="pt")
        batch.pop("labels", None)
        with torch.no_grad():
            out = model.generate(**batch, generation_config=plain, max_new_tokens=steps, do_sample=False,
                                 suppress_tokens=spec["placeholders"](model))
        out = out[0, batch["input_ids"].shape[1]:].tolist()
        answers.append(out[: next((k for k, t in enumerate(out) if t in ends), len(out))])
    return answers


def _with_config(model, **settings):
    """A copy of the model's generation config with ``settings``, set on the model (the caller restores the saved one)."""
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    for key, value in settings.items():
        setattr(model.generation_config, key, value)
    return saved


def _check_against_oracle(name, model, proc, images, explained, answers):
    expected = checks.oracle(name, model, proc, images, PROMPTS, answers)
    for e in explained:
        assert e.maps.shape[0] == len(images) and bool(torch.isfinite(e.maps).all())
        for b, (got, want) in enumerate(zip(e.token_scores, expected[e.method])):
            n = len(answers[b])
            assert float(want[:n].abs().max()) > 0
            torch.testing.assert_close(got[:n], want[:n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{e.method}: {m}")


def _greedy_under_config(name: str, max_len: int, **settings) -> None:
    """explain_caption of the tiny ``name`` VLM whose generation config holds ``settings``: its answers are the model's
    greedy ones (found without them), its maps equal the eager oracle's, and the config is left as set."""
    model, proc = getattr(helpers, name)()
    images = helpers.images(0)
    want = _greedy(name, model, proc, images, PROMPTS, max_len)
    saved = _with_config(model, **settings)
    try:
        before = model.generation_config.to_json_string()
        got = vx.Explainer(model, processor=proc).explain_caption(images, prompt=PROMPTS, method=METHODS,
                                                                  max_len=max_len)
        assert model.generation_config.to_json_string() == before
    finally:
        model.generation_config = saved
    answers = [got[0].ids[b, : len(t)].tolist() for b, t in enumerate(got[0].tokens)]
    assert answers == want and all(answers)
    _check_against_oracle(name, model, proc, images, got, answers)


@pytest.mark.parametrize("cache", ["static", "sliding_window"])
def test_paligemma2_with_a_static_cache_in_its_generation_config_is_explained(cache):
    """PaliGemma 2 (a Gemma 2 LM with sliding-window layers) whose generation config asks for a static cache: generate
    builds one mask per layer type, which PaliGemma's forward reads as a tensor, so explain_caption raised a raw
    AttributeError ("'dict' object has no attribute 'ndim'"). The answer is found with the default cache: it is the
    model's greedy answer, the maps equal the eager oracle's, and the user's config is left as set."""
    _greedy_under_config("paligemma2", 4, cache_implementation=cache)


@pytest.mark.parametrize("cache", ["quantized", "offloaded", "offloaded_static"])
def test_other_caches_in_the_generation_config_give_the_greedy_answer(cache):
    """A quantized cache raised a raw ImportError (optimum-quanto), an offloaded one a CUDA error on a CPU machine read
    as "cannot read an image size": the answer is now the model's greedy answer with its default cache, and the maps
    equal the eager oracle's."""
    _greedy_under_config("llava", 3, cache_implementation=cache)


@pytest.mark.parametrize("setting", [dict(prompt_lookup_num_tokens=2), dict(penalty_alpha=0.6, top_k=4),
                                     dict(dola_layers="low"), dict(token_healing=True), dict(num_return_sequences=2)],
                         ids=["prompt-lookup", "contrastive", "dola", "token-healing", "two-answers"])
def test_a_generation_config_that_asks_for_another_decoding_gives_the_greedy_answer(setting):
    """Settings that turn greedy search into another algorithm: prompt-lookup (assisted) decoding refused a batch ("only
    supported for batch_size = 1"), contrastive search and DoLa asked for ``trust_remote_code`` (their code is on the
    Hub in transformers 5), token healing (which rewrites the prompt's end) asked for the tokenizer, each read as a
    model that "cannot read an image size"; ``num_return_sequences=2`` without beams was refused by transformers
    (which validates the model's config, merged in, before vitexplain's ``num_return_sequences=1`` applies) as a
    generation-config error. Now the answer is the greedy one
    (as with num_beams or do_sample in the config), the maps equal the eager oracle's, and the config is left as set."""
    _greedy_under_config("llava", 3, **setting)


def test_a_generation_config_with_forced_words_is_refused_saying_what_to_do():
    """``force_words_ids`` asks for constrained beam search (its code on the Hub in transformers 5): it was read as a
    model that "cannot read an image size". Greedy search cannot apply it, so it is refused naming the setting; a
    given answer is still explained."""
    model, proc = helpers.llava()
    images = helpers.images(0)
    word = proc.tokenizer.convert_tokens_to_ids("red")
    saved = _with_config(model, force_words_ids=[[word]])
    try:
        with pytest.raises(vx.UnsupportedModelError, match=re.escape(f"sets force_words_ids=[[{word}]], which only "
                                                                      "constrained beam search applies")):
            vx.Explainer(model, processor=proc).explain_caption(images, prompt=PROMPTS, method="cross", max_len=3)
        given = vx.Explainer(model, processor=proc).explain_caption(images, prompt=PROMPTS, method="cross",
                                                                     caption="red circle")
        assert given.tokens == [["red", "circle"]] * 2
    finally:
        model.generation_config = saved


@pytest.mark.parametrize("setting, error", [(dict(begin_suppress_tokens=5), "TypeError"),
                                            (dict(repetition_penalty=0.0), "ValueError")])
def test_a_generation_config_setting_generate_cannot_take_is_refused_naming_the_config(setting, error):
    """A setting ``generate`` cannot take: a TypeError from inside transformers (``begin_suppress_tokens`` an int, not a
    list) came out raw, a ValueError (a repetition penalty of 0) as a model that "cannot read an image size", with
    no word of the generation config. Now both are UnsupportedModelErrors that carry transformers' message and name the
    generation config; a given answer needs no generation and is explained."""
    model, proc = helpers.llava()
    images = helpers.images(0)
    saved = _with_config(model, **setting)
    try:
        ex = vx.Explainer(model, processor=proc)
        with pytest.raises(vx.UnsupportedModelError, match=re.escape(f"could not generate an answer on the batch of "
                                                                      f"LlavaProcessor ({error}: ")) as info:
            ex.explain_caption(images, prompt=PROMPTS, method="cross", max_len=3)
        assert "LlavaForConditionalGeneration.generation_config" in str(info.value)
        assert ex.explain_caption(images, prompt=PROMPTS, method="cross", caption="red circle").tokens == [["red", "circle"]] * 2
    finally:
        model.generation_config = saved


@pytest.mark.parametrize("build, cache", [("git", "static"), ("git", "quantized"), ("vit-gpt2", "quantized"),
                                          ("vit-gpt2", "offloaded")])
def test_a_captioner_whose_generation_config_asks_for_another_cache_still_captions(build, cache):
    """The same for Hugging Face captioners: GIT with a static cache raised a raw RuntimeError ("Tensors must have same
    number of dimensions"), a quantized cache a raw ImportError or ValueError, an offloaded one a CUDA error on a CPU
    machine. Now the caption and maps are those of the plain config."""
    from test_vlm_variants import _git, _vit_gpt2

    model = {"git": _git, "vit-gpt2": _vit_gpt2}[build]()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    want = vx.Explainer(model).explain_caption(x, method="cross", max_len=3)
    model.generation_config.cache_implementation = cache
    got = vx.Explainer(model).explain_caption(x, method="cross", max_len=3)
    assert model.generation_config.cache_implementation == cache
    assert got.tokens == want.tokens and all(got.tokens)
    torch.testing.assert_close(got.maps, want.maps, atol=1e-6, rtol=1e-5)


def llava_mistral(window: int = 8):
    """LLaVA (as :func:`vlm_helpers.llava`) with a Mistral LM whose every layer is a sliding window of ``window``."""
    tok = helpers.tokenizer(("<image>",))
    image = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    proc = transformers.LlavaProcessor(image_processor=image, tokenizer=tok, patch_size=8,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                           image_size=32, patch_size=8)
    text = dict(model_type="mistral", vocab_size=len(tok), sliding_window=window, **helpers._text())
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                                   vision_feature_select_strategy="default", vision_feature_layer=-1)
    return helpers._sdpa_built(transformers.LlavaForConditionalGeneration, cfg, proc)


def test_cross_generic_refuses_words_no_chain_of_sliding_windows_reaches_from_the_image():
    """LLaVA with a Mistral LM whose layers are all sliding windows: ``cross`` and ``cross_grad`` refused an answer row
    whose window had passed the image, but ``cross_generic``, which follows attention from layer to layer, gave the
    words no chain of windows reaches from the image a map of 0 everywhere, silently. Which words those are is read
    here from an eager copy's ``output_attentions`` (their support chained over the layers); now they are refused by
    name, and the words before them get the eager oracle's maps (not 0)."""
    model, proc = llava_mistral()
    images = helpers.images(0)
    prompts = ["what", "what color is the shape on the left of the square and the"]
    words = ["red", "circle", "on", "the"]
    answers = [[proc.tokenizer.convert_tokens_to_ids(w) for w in words]] * 2
    kwargs, start, ids, columns = checks._oracle_inputs("llava", model, proc, images, prompts, answers)
    with torch.no_grad():
        atts = helpers.eager_copy(model)(**kwargs, output_attentions=True, use_cache=False).attentions
    reach = torch.eye(atts[0].shape[-1]).expand(len(images), -1, -1)
    for a in atts:  # R = (I + S_L) ... (I + S_1) on the supports S_l = [A_l > 0]
        reach = ((reach + (a.sum(1) > 0).float() @ reach) > 0).float()
    rows = reach[:, start - 1 : start - 1 + len(words)]
    dead = [[t for t in range(len(words)) if not bool(rows[b, t, cols].any())] for b, cols in enumerate(columns)]
    assert dead[0] == [] and 0 < len(dead[1]) < len(words)  # image 1: some words reach its tokens, later ones do not
    ex = vx.Explainer(model, processor=proc)
    with pytest.raises(vx.UnsupportedMethodError, match=re.escape(f"gives answer word(s) {dead[1]} of image 1 no weight")):
        ex.explain_caption(images, prompt=prompts, method="cross_generic", caption=" ".join(words))
    alive = [a[: dead[1][0]] for a in answers]
    got = ex.explain_caption(images, prompt=prompts, method="cross_generic", caption=alive)
    want = checks.oracle("llava", model, proc, images, prompts, alive)["cross_generic"]
    for a, b in zip(got.token_scores, want):
        assert bool((b.abs().amax(-1) > 0).all())
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("build", ["git", "vit-gpt2"])
def test_a_captioner_whose_generation_config_asks_for_several_answers_gives_the_greedy_caption(build):
    """A captioner whose generation config sets ``num_return_sequences=2`` without beams: transformers validated the
    model's config, merged into the one ``generate`` builds, before vitexplain's ``num_return_sequences=1`` applied,
    and refused it (a ValueError). Now the caption and maps are those of the plain config, which is left as set."""
    from test_vlm_variants import _git, _vit_gpt2

    model = {"git": _git, "vit-gpt2": _vit_gpt2}[build]()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    want = vx.Explainer(model).explain_caption(x, method="cross", max_len=3)
    model.generation_config.num_return_sequences = 2
    got = vx.Explainer(model).explain_caption(x, method="cross", max_len=3)
    assert model.generation_config.num_return_sequences == 2
    assert got.tokens == want.tokens and all(got.tokens)
    torch.testing.assert_close(got.maps, want.maps, atol=1e-6, rtol=1e-5)
