"""Hugging Face models: 'sdpa' captures equal the model's own 'eager' attentions."""

from __future__ import annotations

import copy

import pytest
import torch

import vitexplain as vx

transformers = pytest.importorskip("transformers")


def eager_copy(model):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return ref


def test_hf_vit_sdpa_matches_eager_and_layout():
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8, num_labels=3,
    )
    model = transformers.ViTForImageClassification(config).eval()
    assert model.config._attn_implementation == "sdpa"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        plain = model(pixel_values=x).logits
        with vx.capture(model) as rec:
            captured = model(pixel_values=x).logits
        expected = eager_copy(model)(pixel_values=x, output_attentions=True).attentions
    assert torch.equal(plain, captured)
    assert len(rec.records) == len(expected) == 2
    for record, attn in zip(rec.records, expected):
        assert record.kind == "self" and record.source == "sdpa"
        torch.testing.assert_close(record.probs(), attn, atol=1e-5, rtol=0)
    assert rec.layout.grid == (4, 4) and rec.layout.num_prefix_tokens == 1


def test_hf_gpt2_causal_self_and_cross_attention():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, add_cross_attention=True,
        bos_token_id=0, eos_token_id=1,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    ids, memory = torch.randint(0, 50, (2, 6)), torch.randn(2, 9, 32)
    with torch.no_grad():
        with vx.capture(model) as rec:
            model(input_ids=ids, encoder_hidden_states=memory)
        out = eager_copy(model)(input_ids=ids, encoder_hidden_states=memory, output_attentions=True)
    assert [r.kind for r in rec.records] == ["self", "cross", "self", "cross"]
    for record, attn in zip(rec.select(kind="self"), out.attentions):
        torch.testing.assert_close(record.probs(), attn, atol=1e-5, rtol=0)
        assert torch.all(record.probs()[..., 0, 1:] == 0)
    for record, attn in zip(rec.select(kind="cross"), out.cross_attentions):
        assert record.probs().shape == (2, 2, 6, 9)
        torch.testing.assert_close(record.probs(), attn, atol=1e-5, rtol=0)


def test_hf_eager_implementation_is_captured_from_softmax():
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8,
    )
    model = eager_copy(transformers.ViTModel(config).eval())
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad(), vx.capture(model) as rec:
        out = model(pixel_values=x, output_attentions=True)
    assert [r.source for r in rec.records] == ["eager", "eager"]
    for record, attn in zip(rec.records, out.attentions):
        torch.testing.assert_close(record.probs(), attn)
