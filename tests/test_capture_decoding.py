"""Decoding with Hugging Face models: grouped-query decode steps, sliding windows, padded batches, VLMs.

Oracle: the same tiny random model run with ``attn_implementation="eager"`` and
``output_attentions=True`` (its own softmax, no vitexplain code). ``generate`` of both copies must
produce the same tokens; each step's records are compared with that step's eager attentions.

Grouped-query attention with a mask at a decoding step is where transformers packs the query heads
into query rows (``pack_gqa``); every test that relies on it checks that the packing really ran.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vitexplain as vx

transformers = pytest.importorskip("transformers")
sdpa_attention = pytest.importorskip("transformers.integrations.sdpa_attention")

NEW_TOKENS = 3
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=63)
IMAGE_TOKEN = 62


def _sharpen(model: nn.Module) -> nn.Module:
    """Sharper attention than a random init gives; gates that start at 0 opened (Mllama)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(3.0)
            elif name.endswith("gate"):
                p.fill_(1.0)
    return model.eval()


def _left_padded(batch: int, length: int, pad: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(2, 60, (batch, length))
    mask = torch.ones_like(ids)
    ids[0, :pad], mask[0, :pad] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def llama():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT))
    return _sharpen(model), _left_padded(2, 7, pad=3)


def gemma3():
    config = transformers.Gemma3TextConfig(
        **{**TEXT, "hidden_size": 32}, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    return _sharpen(transformers.Gemma3ForCausalLM(config)), _left_padded(2, 7, pad=2)


def llava():
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4
    )
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=transformers.LlamaConfig(**TEXT), image_token_index=IMAGE_TOKEN
    )
    inputs = _left_padded(2, 22, pad=2)
    inputs["input_ids"][:, 3:19] = IMAGE_TOKEN  # the 4 x 4 patches
    inputs["pixel_values"] = torch.randn(2, 3, 16, 16)
    return _sharpen(transformers.LlavaForConditionalGeneration(config)), inputs


def mllama():
    vision = transformers.MllamaVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
        image_size=16, patch_size=4, max_num_tiles=1, intermediate_layers_indices=[0], vision_output_dim=64,
        supported_aspect_ratios=[[1, 1]],
    )
    text = transformers.MllamaTextConfig(**TEXT, cross_attention_layers=[1])
    config = transformers.MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    inputs = _left_padded(2, 6, pad=1)
    inputs["input_ids"][:, 1] = IMAGE_TOKEN
    inputs.update(
        pixel_values=torch.randn(2, 1, 1, 3, 16, 16),
        aspect_ratio_ids=torch.ones(2, 1, dtype=torch.long),
        aspect_ratio_mask=torch.ones(2, 1, 1, dtype=torch.long),
        cross_attention_mask=torch.ones(2, 6, 1, 1, dtype=torch.long),
    )
    return _sharpen(transformers.MllamaForConditionalGeneration(config)), inputs


def eager_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return ref


@pytest.fixture
def packing(monkeypatch) -> list[int]:
    """Counts transformers' ``pack_gqa`` calls on queries (the packed path the capture undoes)."""
    calls: list[int] = []
    original = sdpa_attention.pack_gqa

    def counting(hidden_states, n_rep):
        calls.append(n_rep)
        return original(hidden_states, n_rep)

    monkeypatch.setattr(sdpa_attention, "pack_gqa", counting)
    return calls


def _text_records(rec) -> list:
    return [r for r in rec.records if "vision" not in r.name]


def _generate_both(build, attention_mode: str = "fused"):
    torch.manual_seed(0)
    model, inputs = build()
    options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        with vx.capture(model, attention_mode=attention_mode) as rec:
            tokens = model.generate(**inputs, **options)
        expected = eager_copy(model).generate(**inputs, **options, output_attentions=True, return_dict_in_generate=True)
    assert torch.equal(tokens, expected.sequences)  # same tokens, so the same calls on both sides
    return rec, inputs, expected.attentions


def _assert_close_on_tokens(probs: torch.Tensor, expected: torch.Tensor, padded: torch.Tensor | None) -> None:
    """probs == expected on the query rows of real tokens: a padded query row (B, N_q) attends to no
    key, which the eager softmax spreads uniformly and the fused kernel gives as 0."""
    if padded is not None:
        keep = ~padded[:, None, :, None].expand_as(probs)
        probs, expected = probs[keep], expected[keep]
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("build", [llama, gemma3, llava, mllama], ids=lambda f: f.__name__)
@pytest.mark.parametrize("attention_mode", ["fused", "materialize"])
def test_decode_steps_match_eager(build, attention_mode, packing):
    rec, inputs, steps = _generate_both(build, attention_mode)
    assert packing, "transformers did not pack the grouped-query decode steps: this test no longer covers them"
    records = _text_records(rec)
    layers = len(steps[0])
    assert len(records) == layers * NEW_TOKENS
    padded = inputs["attention_mask"] == 0
    for t, step in enumerate(steps):
        for layer, expected in enumerate(step):
            record = records[t * layers + layer]
            assert record.step == t
            assert record.probs().shape == expected.shape == (2, 4, expected.shape[2], expected.shape[3])
            _assert_close_on_tokens(record.probs(), expected, padded if t == 0 else None)
            torch.testing.assert_close(record.probs(queries=-1), record.probs()[..., -1:, :])


def test_gemma3_sliding_window_layers_keep_their_window_at_decode_steps():
    rec, _, steps = _generate_both(gemma3)
    sliding, full = _text_records(rec)[-2:]  # the last decode step: layer 0 slides (window 4), layer 1 does not
    assert sliding.num_keys == steps[-1][0].shape[-1] == 4 and full.num_keys == steps[-1][1].shape[-1] == 7 + NEW_TOKENS - 1


def test_mllama_cross_attention_is_cross_also_when_its_keys_come_from_the_cache():
    rec, inputs, steps = _generate_both(mllama)
    records = _text_records(rec)
    assert [(r.name.rsplit(".", 1)[-1], r.kind) for r in records] == [("self_attn", "self"), ("cross_attn", "cross")] * 3
    image_tokens = steps[0][1].shape[-1]
    for t, record in enumerate(rec.select(kind="cross")):
        assert record.num_keys == image_tokens  # prefill: from cross_attention_states; later: from the cache
        _assert_close_on_tokens(record.probs(), steps[t][1], inputs["attention_mask"] == 0 if t == 0 else None)


@pytest.mark.parametrize("attention_mode", ["fused", "materialize"])
def test_packed_decode_step_gradients_match_eager(attention_mode, packing):
    torch.manual_seed(0)
    model, inputs = llama()
    ref = eager_copy(model)
    step = {"input_ids": torch.tensor([[5], [9]]), "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1)}
    with torch.no_grad():
        cache, ref_cache = model(**inputs).cache, ref(**inputs).cache
    with vx.capture(model, grads=True, attention_mode=attention_mode) as rec:
        logits = model(**step, cache=cache).logits
    assert packing
    score = logits[:, -1, 7].sum()
    d_outs = torch.autograd.grad(score, [r.output for r in rec.records], retain_graph=True)  # packed (B, H_kv, G, E)
    rec.zero_grad()  # (the hooks saw that pass too)
    rec.backward(score)
    out = ref(**step, cache=ref_cache, output_attentions=True)
    for a in out.attentions:
        a.retain_grad()
    out.logits[:, -1, 7].sum().backward()
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)
    # dy/dA at a padded key is dO . v of that key, and the two copies hold different values there
    # (eager spreads a padded query row over all keys in the prefill, SDPA gives 0): compare real keys
    real = step["attention_mask"].bool()[:, None, None, :].expand(-1, 4, 1, -1)
    for record, expected, d_out in zip(rec.records, out.attentions, d_outs, strict=True):
        assert record.materialized == (attention_mode == "materialize")
        torch.testing.assert_close(record.probs(), expected.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(record.grad_probs()[real], expected.grad[real], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(record.grad_probs(d_out=d_out)[real], expected.grad[real], atol=1e-5, rtol=1e-4)


def test_forward_index_numbers_the_top_level_calls_of_generate():
    """LLaVA's generate encodes the image (get_image_features, not the model's forward) before its first forward."""
    rec, _, _ = _generate_both(llava)
    indices = [(r.name.split(".")[1], r.forward_index) for r in rec.records]
    assert indices == [("vision_tower", 0)] * 2 + [(m, i) for i in (1, 2, 3) for m in ("language_model",) * 2]
    assert [r.step for r in rec.select(forward_index=3)] == [2, 2]
    assert rec.select(prefix="model.vision_tower") == rec.select(forward_index=0)


def test_forward_index_counts_calls_of_the_model_and_restarts_after_clear():
    torch.manual_seed(0)
    model, inputs = llama()
    with torch.no_grad(), vx.capture(model, activations=["model.layers.1"]) as rec:
        model(**inputs)
        model.model.layers[0](torch.randn(2, 7, 32), position_embeddings=model.model.rotary_emb(torch.randn(2, 7, 32), torch.arange(7)[None]))
        model(**inputs)
        assert [r.forward_index for r in rec.records] == [0, 0, 1, 2, 2]
        assert [a.forward_index for a in rec.activations["model.layers.1"]] == [0, 2]
        rec.clear()
        model(**inputs)
    assert [r.forward_index for r in rec.records] == [0, 0]


def _large_keys_llama(kv_heads: int) -> tuple[nn.Module, dict, dict]:
    """A Llama whose prompt's keys (a left-padded batch of 2) reach ``early.KEYS_BYTES``, its inputs and generate
    options."""
    from vitexplain.recording import early

    config = transformers.LlamaConfig(**{**TEXT, "hidden_size": 256, "num_attention_heads": 4,
                                         "num_key_value_heads": kv_heads, "max_position_embeddings": 2048})
    torch.manual_seed(0)
    model = _sharpen(transformers.LlamaForCausalLM(config))
    per_token = 2 * kv_heads * (config.hidden_size // config.num_attention_heads) * 4  # key bytes, both images
    inputs = _left_padded(2, early.KEYS_BYTES // per_token + 1, pad=3)
    return model, inputs, dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("capture", ["first", "lanes"])
def test_decoding_steps_over_large_keys_keep_their_probabilities_not_the_keys(capture, kv_heads, packing):
    """A dynamic KV cache grows by concatenation: each decoding step's keys are a new tensor that only the step's
    record kept alive, so a generate of T steps held about T caches' worth of keys (quadratic in the length).
    A decoding step whose keys are large (recording/early.py, KEYS_BYTES) keeps its probabilities instead, computed
    at the call: E H_kv / H times fewer bytes. The prompt's call, whose probabilities are larger than its keys,
    keeps q and k. A left-padded batch, so that the grouped-query steps are packed (as transformers does with a
    mask). Oracle: the eager copy's attentions, on the checked path and on the lanes of a later capture."""
    model, inputs, options = _large_keys_llama(kv_heads)
    with torch.no_grad():
        expected = eager_copy(model).generate(**inputs, **options, output_attentions=True, return_dict_in_generate=True)
        if capture == "lanes":
            with vx.capture(model):
                model.generate(**inputs, **options)
        with vx.capture(model) as rec:
            tokens = model.generate(**inputs, **options)
    assert torch.equal(tokens, expected.sequences)
    assert bool(packing) == (kv_heads < 4)
    want = [layer for step in expected.attentions for layer in step]
    assert len(rec.records) == len(want) == model.config.num_hidden_layers * NEW_TOKENS
    padded = inputs["attention_mask"] == 0
    for record, attention in zip(rec.records, want):
        decoding = record.num_queries == 1
        assert (record._k is None and record._q is None) == decoding, record
        if decoding:  # what it holds is its probabilities, (2, H, 1, N_k) float32
            assert record._probs.shape == attention.shape and record._probs.dtype == torch.float32
        _assert_close_on_tokens(record.probs(), attention, None if decoding else padded)


@pytest.mark.parametrize("capture", ["first", "lanes"])
def test_decoding_steps_over_large_keys_keep_only_the_head_fusion_asked_for(capture):
    """vx.capture(..., heads="mean") keeps only the head mean of the probabilities the capture computes: so do the
    decoding steps that keep theirs (early.py), H times fewer bytes; probs() says to ask for the fusion. Oracle:
    the head mean of the eager copy's attentions."""
    model, inputs, options = _large_keys_llama(4)
    with torch.no_grad():
        expected = eager_copy(model).generate(**inputs, **options, output_attentions=True, return_dict_in_generate=True)
        if capture == "lanes":
            with vx.capture(model, heads="mean"):
                model.generate(**inputs, **options)
        with vx.capture(model, heads="mean") as rec:
            model.generate(**inputs, **options)
    want = [layer for step in expected.attentions for layer in step]
    decoding = [(r, a) for r, a in zip(rec.records, want) if r.num_queries == 1]
    assert len(decoding) == 4
    for record, attention in decoding:
        assert record._probs.shape == (2, 1, attention.shape[-1])  # (B, N_q, N_k): the mean alone
        torch.testing.assert_close(record.fused_probs("mean"), attention.mean(dim=1), atol=1e-5, rtol=0)
        with pytest.raises(vx.CaptureError, match="kept only the mean"):
            record.probs()
