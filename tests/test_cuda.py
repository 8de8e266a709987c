"""CUDA checks: fused kernels under capture, low-precision maps. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def model():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=64, patch_size=8, embed_dim=64, depth=3, num_heads=2, num_classes=5).eval().cuda()


def test_capture_keeps_flash_or_efficient_kernels(model):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.randn(4, 3, 64, 64, device="cuda", dtype=torch.float16)
    half = model.half()
    try:
        # the math fallback is not allowed: a capture that forced it would raise here
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            with torch.no_grad(), vx.capture(half) as rec:
                half(x)
            generic = vx.Explainer(half).explain(x, method="generic")
    finally:
        model.float()
    assert rec.records[0].probs().dtype == torch.float32
    assert torch.isfinite(generic.maps).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_maps_match_fp32(model, dtype):
    x = torch.randn(4, 3, 64, 64, device="cuda")
    ex = vx.Explainer(model)
    reference = ex.explain(x, method=["rollout", "cdam"])
    with torch.autocast("cuda", dtype=dtype):
        low = ex.explain(x, method=["rollout", "cdam"])
    for ref, got in zip(reference, low):
        assert vx.metrics.rank_correlation(got.maps, ref.maps).min() > 0.95, ref.method
