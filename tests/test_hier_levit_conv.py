"""timm LeViT in conv mode (``levit_conv_*``, ``use_conv=True``): the hierarchical family, as in linear mode.

Its blocks are linear-mode LeViT's on (B, C, H, W) maps (1 x 1 convs; queries subsampled by an average pooling
of kernel 1). The attention methods against the dense float64 oracle: tests/test_hier_pooling.py (kind
``levit_conv``). Here: CDAM at every stage against central differences of the model's own output when a
token of the (B, C, H, W) map entering the stage's last attention is scaled; a batch against its images
one by one; the plan lists the hierarchical methods (it used to be a Grad-CAM-only hybrid).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitexplain as vx
from hier_oracle import token_derivative

timm = pytest.importorskip("timm")

SIZE = (64, 64)


def build(seed: int = 0) -> nn.Module:
    """A tiny ``levit_conv_128s`` (grids 4 x 4, 2 x 2, 1 x 1 at 64 px) with N(0, 1) attention biases and a
    non-zero head (timm leaves both zero: every map would be flat)."""
    torch.manual_seed(seed)
    model = timm.create_model("levit_conv_128s", pretrained=False, num_classes=5, img_size=64, embed_dim=(32, 48, 64),
                              depth=(2, 2, 1), num_heads=(2, 2, 2), key_dim=8).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "attention_biases", None), nn.Parameter):
                module.attention_biases.normal_(0, 1)
                module.attention_bias_cache = {}
            if isinstance(module, nn.Linear) and module.out_features == 5:
                module.weight.normal_(0, 0.5)
    return model


def test_levit_conv_is_hierarchical_with_the_attention_and_token_methods():
    ex = vx.Explainer(build())
    assert ex.family == "hier"
    assert {"raw", "rollout", "grad_rollout", "generic", "cdam", "gradcam"} <= set(ex.methods())


@pytest.mark.parametrize("stage", [0, 1])
def test_levit_conv_cdam_at_each_stage_matches_finite_differences(stage):
    """S_(i,j) = d/de y when cell (i, j) of the (B, C, H, W) map entering the stage's last attention (the output of
    the block before it) is scaled by (1 + e)."""
    model = build().double()
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    e = vx.Explainer(model).explain(x, method="cdam", target=2, stage=stage)
    grid = (4, 4) if stage == 0 else (2, 2)
    assert e.maps.shape == (1, *grid)
    module = model.get_submodule(f"stages.{stage}.blocks.0")
    scale = 0.0
    for i in range(grid[0]):
        for j in range(grid[1]):
            numeric = token_derivative(module, (slice(None), i, j), lambda: model(x)[0, 2])
            scale = max(scale, abs(numeric))
            assert abs(float(e.maps[0, i, j]) - numeric) <= 1e-6 + 1e-5 * abs(numeric), (i, j, numeric)
    assert scale > 0


def test_levit_conv_batch_equals_its_images_one_by_one():
    ex = vx.Explainer(build(seed=1))
    x = torch.randn(3, 3, *SIZE, generator=torch.Generator().manual_seed(4))
    for method, options in (("rollout", {}), ("generic", {}), ("generic", {"stage": 1}), ("grad_rollout", {}),
                            ("cdam", {}), ("cdam", {"stage": 0}), ("gradcam", {"stage": 1}), ("raw", {"layer": 1})):
        together = ex.explain(x, method=method, target=1, **options).maps
        alone = torch.cat([ex.explain(x[i:i + 1], method=method, target=1, **options).maps for i in range(3)])
        # (token Grad-CAM's ReLU can zero a random model's whole map; cdam reads the same site signed)
        assert together.shape[0] == 3 and (method == "gradcam" or bool(alone.abs().max() > 0)), method
        torch.testing.assert_close(together, alone, atol=1e-5 * float(alone.abs().max()) + 1e-9, rtol=1e-4)
