"""Hugging Face SAM 3 image encoder backbone (``Sam3ViTModel``): windowed (zero-padded) and global attention
with rotary positions on one grid. Rollout, Chefer's rule and gradient rollout against a dense float64 oracle
built here from an eager float64 copy's softmax outputs (taped) and SAM 3's own ``window_partition`` applied
to token indices; CDAM against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitexplain as vx
from hier_oracle import DenseCall, assert_matches_oracle, carry, scatter_windows, taped_attention, token_derivative

transformers = pytest.importorskip("transformers")

SIZE = (112, 112)  # patch 14: an 8 x 8 grid, windows of 3 (padded to 9 x 9)
VECTOR = torch.randn(32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Sam3ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                                        image_size=SIZE[0], patch_size=14, window_size=3, global_attn_indexes=[1, 3],
                                        pretrain_image_size=56)
    model = transformers.Sam3ViTModel(config)
    with torch.no_grad():  # unit-ish gain for every weight matrix: random init's relevance is too small to resolve
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / p[0].numel() ** 0.5)
    return model.eval()


def _score(model, x):
    return model(pixel_values=x).last_hidden_state.mean(dim=1) @ VECTOR.to(x.dtype)


def test_sam3_backbone_matches_the_dense_float64_oracle():
    from transformers.models.sam3.modeling_sam3 import window_partition

    model = build()
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    grid = (SIZE[0] // 14, SIZE[1] // 14)
    n, b = grid[0] * grid[1], x.shape[0]
    items = []
    for layer, (a, g) in zip(model.layers, taped_attention(model, x, _score)):
        if layer.window_size > 0:  # the model's own partition of token indices (+1: padding is 0)
            idx, _ = window_partition((torch.arange(n) + 1).view(1, *grid, 1).double(), layer.window_size)
            idx = idx.reshape(idx.shape[0], -1).long() - 1
            a = a.reshape(b, idx.shape[0], -1, *a.shape[-2:])  # (B * nW, heads, n, n)
            g = g.reshape(b, idx.shape[0], -1, *g.shape[-2:])
            a, g = scatter_windows(a, idx, idx, n, n), scatter_windows(g, idx, idx, n, n)
        else:
            a, g = a.reshape(b, -1, n, n).double(), g.reshape(b, -1, n, n).double()
        items.append(DenseCall(a, g, torch.eye(n, dtype=torch.float64), torch.eye(n, dtype=torch.float64)))
    ex = vx.Explainer(model)
    assert ex.family == "hier" and not ex.adapter.has_head
    u = torch.full((b, n), 1.0 / n, dtype=torch.float64)  # the pooled embedding: the mean of the tokens
    methods = ["rollout", "generic", "grad_rollout"]
    for method, e in zip(methods, ex.explain(x, method=methods, target=lambda pooled: pooled @ VECTOR.float())):
        assert tuple(e.maps.shape) == (b, *grid) and e.layout.grid == grid
        assert_matches_oracle(e.maps, carry(items, u, method).view(e.maps.shape), method)


def test_sam3_backbone_cdam_matches_finite_differences_and_refuses_another_size():
    model = build().double()
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ex = vx.Explainer(model)
    e = ex.explain(x, method="cdam", target=lambda pooled: pooled @ VECTOR)
    site = model.layers[-1].layer_norm1  # CDAM: the tokens entering the last attention, scaled one by one
    for cell in [(0, 0), (3, 5), (7, 7)]:
        # SAM 3 computes its rotary angles in float32 even in a float64 model, so the score is float32-noisy:
        # a step of 1e-3 keeps that noise (~1e-7 / step) and the truncation (~step^2) both under 1e-4 relative
        want = token_derivative(site, cell, lambda: _score(model, x), eps=1e-3)
        torch.testing.assert_close(e.maps[0][cell].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-8)
    with pytest.raises(vx.InputError, match="112x112"):
        ex.explain(torch.randn(1, 3, 98, 98, dtype=torch.float64), method="rollout", target=vx.targets.norm())


def test_sam3_images_are_preprocessed_as_its_image_processor_does():
    """SAM 3's image processor resizes to the model's size and normalises with mean and std 0.5 (bilinear); images
    got timm's defaults (ImageNet statistics, a 0.875 center crop, bicubic). At the model's size (nothing resampled)
    the preprocessed images equal the processor's."""
    ex = vx.Explainer(build())
    processor = transformers.Sam3ImageProcessor(size={"height": SIZE[0], "width": SIZE[1]})
    rng = np.random.default_rng(3)
    image = rng.integers(0, 255, (*SIZE, 3), dtype=np.uint8)
    torch.testing.assert_close(ex.preprocess([image])[0], processor([image], return_tensors="pt").pixel_values,
                               rtol=0, atol=1e-6)


def test_sam3_vision_model_and_full_model_are_refused_naming_the_backbone_which_is_explained():
    """Sam3VisionModel wraps the ViT backbone with a feature-pyramid neck (its fpn_hidden_states are what SAM 3
    reads) and Sam3Model decodes masks from prompts: both are refused with the reason and the module to explain
    (they used to get the generic 'does not know how to explain'), and that module is explained."""
    backbone = build().config
    vision = transformers.Sam3VisionConfig(backbone_config=backbone, fpn_hidden_size=16)
    torch.manual_seed(0)
    model = transformers.Sam3VisionModel(vision).eval()
    with pytest.raises(vx.UnsupportedModelError, match=r"Sam3VisionModel is not supported.*feature pyramid.*"
                                                       r"vx\.Explainer\(model\.backbone\)"):
        vx.Explainer(model)
    e = vx.Explainer(model.backbone).explain(torch.randn(2, 3, *SIZE), method="generic", target=vx.targets.norm())
    assert e.maps.shape == (2, 8, 8) == (2, *e.layout.grid)
    with torch.device("meta"):  # the full model's text and detection parts are large: its detection only is checked
        full = transformers.Sam3Model(transformers.Sam3Config(vision_config=vision))
    with pytest.raises(vx.UnsupportedModelError, match=r"Sam3Model is not supported.*masks decoded from prompts.*"
                                                       r"vx\.Explainer\(model\.vision_encoder\.backbone\)"):
        vx.Explainer(full)
