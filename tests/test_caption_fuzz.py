"""explain_caption on captioners fuzzed with other configurations than the main tests use: a Hugging Face
VisionEncoderDecoder whose decoder config lacks the start or end token, ... Tiny random-init models (plumbing);
each case names the bug it pins."""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx

transformers = pytest.importorskip("transformers")

_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def _vit_bert(start=None, end=None):
    """ViT encoder + BERT decoder as ``from_encoder_decoder_configs`` builds it: BERT has no eos token, and the
    composite config no ``decoder_start_token_id`` until the user sets them."""
    enc = transformers.ViTConfig(**_SMALL, image_size=32, patch_size=8)
    dec = transformers.BertConfig(**_SMALL, vocab_size=40, max_position_embeddings=16, is_decoder=True,
                                  add_cross_attention=True)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.pad_token_id, cfg.decoder_start_token_id = 0, start
    torch.manual_seed(0)
    model = transformers.VisionEncoderDecoderModel(cfg).eval()
    model.generation_config.eos_token_id = end
    return model


def test_a_decoder_without_start_or_end_token_is_refused_with_what_to_set():
    """Bug: ``int(None)`` came out as a bare TypeError from the adapter's start_id / end_id, for generated and given
    captions alike. Now an UnsupportedModelError naming the config field to set; once set, the maps come out."""
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    ex = vx.Explainer(_vit_bert(end=2))
    for caption in (None, [[5, 6], [7]]):
        with pytest.raises(vx.UnsupportedModelError, match=r"decoder_start_token_id"):
            ex.explain_caption(x, method="cross", caption=caption, max_len=3)
    ex = vx.Explainer(_vit_bert(start=1))
    for caption in (None, [[5, 6], [7]]):
        with pytest.raises(vx.UnsupportedModelError, match=r"eos_token_id"):
            ex.explain_caption(x, method="cross", caption=caption, max_len=3)
    e = vx.Explainer(_vit_bert(start=1, end=2)).explain_caption(x, method="cross", caption=[[5, 6], [7]])
    assert e.maps.shape == (2, 2, 4, 4) and torch.isfinite(e.maps).all()
