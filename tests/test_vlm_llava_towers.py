"""LLaVA with either vision tower and either feature strategy: the image tokens the adapter maps
are exactly those the language model sees (a CLIP tower's class token is kept without pixels by
the "full" strategy; a SigLIP tower has no class token, so "full" keeps only its patches)."""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx

transformers = pytest.importorskip("transformers")
import vlm_helpers  # noqa: E402


def _llava(tower: str, strategy: str):
    tok = vlm_helpers.tokenizer(("<image>",))
    image = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    extra = 1 if tower == "clip" and strategy == "full" else 0
    proc = transformers.LlavaProcessor(image_processor=image, tokenizer=tok, patch_size=8,
                                       vision_feature_select_strategy=strategy,
                                       num_additional_image_tokens=1 if tower == "clip" else 0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    vision = transformers.CLIPVisionConfig(**small) if tower == "clip" else transformers.SiglipVisionConfig(**small)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=dict(model_type="llama", vocab_size=len(tok), **vlm_helpers._text()),
                                   image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_select_strategy=strategy,
                                   vision_feature_layer=-1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return vlm_helpers.reinit_small(transformers.LlavaForConditionalGeneration(cfg).eval()), proc, 16 + extra


# (a SigLIP tower with the "default" strategy: LLaVA drops its first real patch, tested below)
@pytest.mark.parametrize("tower, strategy", [("clip", "default"), ("clip", "full"), ("siglip", "full")])
def test_image_tokens_match_what_the_language_model_sees(tower, strategy):
    model, proc, tokens = _llava(tower, strategy)
    images = vlm_helpers.images(3, ((32, 32),))
    inputs = proc(images=images, text=["<image>a"], return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == tokens  # the processor's count
    e = vx.Explainer(model, processor=proc).explain_caption(images, method="cross", prompt="a", max_len=2)
    assert e.token_scores[0].shape[-1] == tokens  # every image token the language model sees
    maps = e.image_maps[0]  # the 4 x 4 pixel-bearing tokens drawn over the 32 x 32 image
    assert torch.isfinite(maps).all() and maps.shape[-2:] == (32, 32) and float(maps.std()) > 0


def test_a_siglip_tower_with_the_default_strategy_drops_its_first_patch():
    """LLaVA's "default" strategy drops the first vision token: a SigLIP tower has no class token, so the language
    model sees patches 1..15 of the 4 x 4 grid (the processor counts 15 too). The adapter counted 16 and refused the
    model, saying the processor and the model disagree (they agree). Now the 15 tokens are mapped to patches 1..15 and
    patch (0, 0), which no token carries, is 0 in every map: by hand, on the 32 x 32 crop in 8 px patches."""
    model, proc, _ = _llava("siglip", "default")
    images = vlm_helpers.images(4, ((32, 32),))
    inputs = proc(images=images, text=["<image>a"], return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 15
    with torch.no_grad():
        assert model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output[0].shape[0] == 15
    e = vx.Explainer(model, processor=proc).explain_caption(images, method="cross", prompt="a", caption="red circle")
    scores, maps = e.token_scores[0], e.image_maps[0]  # (2, 15), (2, 32, 32)
    assert scores.shape == (2, 15) and float(scores.min()) > 0
    for k in range(16):
        r, c = divmod(k, 4)
        cell = maps[:, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8]
        want = torch.zeros(2) if k == 0 else scores[:, k - 1]
        torch.testing.assert_close(cell, want[:, None, None].expand_as(cell))
