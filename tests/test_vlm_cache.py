"""Vision-language models whose generation config asks for another KV cache (static, sliding-window, quantized,
offloaded), and the generation settings a checkpoint may carry (tiny random-init builds of tests/vlm_helpers.py).

The expectation is independent of the code under test: the model's own greedy ``generate`` with its default cache
(one image alone) for the answer, and the eager-attention oracle of tests/vlm_checks.py (``output_attentions`` of an
eager copy) for the maps.
"""

from __future__ import annotations

import copy

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


@pytest.mark.parametrize("cache", ["static", "sliding_window"])
def test_paligemma2_with_a_static_cache_in_its_generation_config_is_explained(cache):
    """PaliGemma 2 (a Gemma 2 LM with sliding-window layers) whose generation config asks for a static cache: generate
    builds one mask per layer type, which PaliGemma's forward reads as a tensor, so explain_caption raised a raw
    AttributeError ("'dict' object has no attribute 'ndim'"). The answer is found with the default cache: it is the
    model's greedy answer, the maps equal the eager oracle's, and the user's config is left as set."""
    model, proc = helpers.paligemma2()
    images = helpers.images(0)
    want = _greedy("paligemma2", model, proc, images, PROMPTS, 4)
    saved = _with_config(model, cache_implementation=cache)
    try:
        before = model.generation_config.to_json_string()
        got = vx.Explainer(model, processor=proc).explain_caption(images, prompt=PROMPTS, method=METHODS, max_len=4)
        assert model.generation_config.to_json_string() == before
    finally:
        model.generation_config = saved
    answers = [got[0].ids[b, : len(t)].tolist() for b, t in enumerate(got[0].tokens)]
    assert answers == want and all(answers)
    _check_against_oracle("paligemma2", model, proc, images, got, answers)


@pytest.mark.parametrize("cache", ["quantized", "offloaded", "offloaded_static"])
def test_other_caches_in_the_generation_config_give_the_greedy_answer(cache):
    """A quantized cache raised a raw ImportError (optimum-quanto), an offloaded one a CUDA error on a CPU machine read
    as "cannot read an image size": the answer is now the model's greedy answer with its default cache, and the maps
    equal the eager oracle's."""
    model, proc = helpers.llava()
    images = helpers.images(0)
    want = _greedy("llava", model, proc, images, PROMPTS, 3)
    saved = _with_config(model, cache_implementation=cache)
    try:
        got = vx.Explainer(model, processor=proc).explain_caption(images, prompt=PROMPTS, method=METHODS, max_len=3)
    finally:
        model.generation_config = saved
    answers = [got[0].ids[b, : len(t)].tolist() for b, t in enumerate(got[0].tokens)]
    assert answers == want and all(answers)
    _check_against_oracle("llava", model, proc, images, got, answers)


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
