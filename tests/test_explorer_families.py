"""The explorer on every capturable family of the support matrix (tiny random models).

Per family: the page data has the views that apply (attention for ViTs and captioner encoders,
none for windowed attention, with a note) and its attention rows are the model's own: the
dequantised last-layer row of the first query equals the capture's ``probs()`` within the
quantisation step (an independent forward under ``vx.capture``).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import timm
import torch

import vitexplain as vx
from vitexplain.explorer.quantize import dequantize_rows

transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")


def _timm_vit(**kwargs):
    kwargs.setdefault("num_classes", 3)
    return timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_heads=2, embed_dim=16, **kwargs)


def _deit_distilled():
    from timm.models.deit import VisionTransformerDistilled

    return VisionTransformerDistilled(img_size=32, patch_size=8, depth=2, num_heads=2, embed_dim=16, num_classes=3)


def _hf_vit():
    config = transformers.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                    image_size=32, patch_size=8, num_labels=3)
    return transformers.ViTForImageClassification(config)


def _torch_captioner():
    from vitexplain.adapters.captioning import TransformerDecoderCaptioner

    model = TransformerDecoderCaptioner(_timm_vit(num_classes=0), vocab_size=12, dim=16, depth=2, heads=2)
    model.pretrained_cfg = dict(model.encoder.pretrained_cfg, input_size=(3, 32, 32))  # preprocess at 32 px
    return model


def _hf_captioner():
    enc = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 image_size=32, patch_size=8)
    dec = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=40, n_positions=32,
                                  add_cross_attention=True, is_decoder=True, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id = 0, 1, 1
    return transformers.VisionEncoderDecoderModel(config=cfg)


FAMILIES = {
    # name: (builder, methods, expected prefix token labels); timm Swin (windowed attention, no
    # single grid: no attention views) has no Explainer adapter yet, so it is not explorable
    "timm-vit-registers": (lambda: _timm_vit(reg_tokens=2), ["rollout", "cdam"], ["[CLS]", "[REG0]", "[REG1]"]),
    "timm-avgpool-no-class-token": (lambda: _timm_vit(class_token=False, global_pool="avg"), ["rollout"], []),
    "timm-deit-distilled": (_deit_distilled, ["rollout"], ["[CLS]", "[DIST]"]),
    "torchvision-vit": (lambda: torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=3), ["rollout"], ["[CLS]"]),
    "hf-vit": (_hf_vit, ["rollout", "cdam"], ["[CLS]"]),
    "torch-decoder-captioner": (_torch_captioner, ["cross"], ["[CLS]"]),
    "hf-vision-encoder-decoder": (_hf_captioner, ["cross"], ["[CLS]"]),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_explore_family(name, tmp_path) -> None:
    build, methods, prefix = FAMILIES[name]
    torch.manual_seed(0)
    model = build().eval()
    image = (np.random.default_rng(1).random((40, 48, 3)) * 255).astype(np.uint8)
    page = vx.explore(model, image, tmp_path / "p.html", methods=methods, top_k=2, max_len=4).read_text()
    data = json.loads(re.search(r'id="vx-data">(.*?)</script>', page, re.S).group(1))["images"][0]
    assert data["methods"] or data["caption"]["methods"]
    att = data["attention"]
    assert att["tokens"] == prefix and att["prefix"] == len(prefix)
    ex = vx.Explainer(model)
    if data["family"] == "caption":
        assert data["caption"]["words"] == data["predictions"][0]["label"].split()
        return
    x = ex.preprocess(image)[0]
    with torch.no_grad(), vx.capture(model) as rec:
        ex.adapter.forward(x)
    exact = rec.records[-1].probs()[0, 0, 0].numpy()  # last layer, head 0, query 0
    p, n, heads = att["prefix"], exact.shape[0], len(att["heads"])
    rows = dequantize_rows(att["probs"]["patches"]).reshape(len(att["layerIndex"]), heads, n, n - p)
    assert np.abs(rows[-1, 0, 0] - exact[p:]).max() <= exact[p:].max() / 510 * 1.001
