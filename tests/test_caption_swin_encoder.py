"""Captioners whose image encoder is a Swin (Hugging Face VisionEncoderDecoder: SwinModel or Donut's DonutSwinModel
encoder, GPT-2 decoder).

``cross_generic`` starts from the encoder's relevance R_ii by the ViT self-attention rule (one global attention
over the image tokens the decoder reads); a windowed, hierarchical encoder has no such attention, and the method
crashed inside (a RuntimeError on the windows folded into the batch). It is refused by the plan with the reason;
``cross`` (the decoder's cross-attention over the encoder's last-stage tokens) runs and equals the model's own
eager cross-attentions (mean over heads and layers) on the same tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

import vitexplain as vx

transformers = pytest.importorskip("transformers")


def build(encoder: str):
    torch.manual_seed(0)
    enc = getattr(transformers, encoder)(image_size=32, patch_size=4, window_size=4, embed_dim=16, depths=[2, 2],
                                         num_heads=[2, 4])
    dec = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=40, n_positions=32, bos_token_id=1,
                                  eos_token_id=2, add_cross_attention=True, is_decoder=True)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = 1, 2
    return transformers.VisionEncoderDecoderModel(cfg).eval()


@pytest.mark.parametrize("encoder", ["SwinConfig", "DonutSwinConfig"])
def test_a_swin_encoder_captioner_refuses_cross_generic_and_its_cross_maps_match_eager(encoder):
    model = build(encoder)
    ex = vx.Explainer(model)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    assert ex.family == "caption" and "cross" in ex.methods() and "cross_generic" not in ex.methods()
    with pytest.raises(vx.UnsupportedMethodError, match=r"windowed, hierarchical.*use 'cross'"):
        ex.explain_caption(x, method="cross_generic", max_len=3)
    forced = ex.explain_caption(x, method="cross", caption=[[5, 7, 9], [4, 6, 8]])
    assert forced.maps.shape == (2, 3, 4, 4)  # the last stage's 4 x 4 tokens
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    ids = forced.ids
    inputs = torch.cat([torch.full_like(ids[:, :1], ex.adapter.start_id), ids[:, :-1]], 1)
    with torch.no_grad():
        cross = ref(pixel_values=x, decoder_input_ids=inputs, output_attentions=True).cross_attentions
    expected = torch.stack([c.mean(1) for c in cross]).mean(0)  # (B, T, 16)
    torch.testing.assert_close(forced.maps.reshape(2, 3, 16), expected[:, :3], atol=1e-5, rtol=1e-4)
