"""What fuzzing the one plan found: each listed method runs or refuses with a vitexplain error on
models, sizes and options the other tests do not use, and its options are not taken blindly."""

from __future__ import annotations

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitexplain as vx


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(5)
    return VisionTransformer(img_size=(24, 40), patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5).eval()


def test_an_occlusion_batch_larger_than_the_patches_runs_the_patches_it_has(vit):
    # batch_size is how many occluded copies run per forward: more than the grid's patches (3 x 5)
    # is all of them; captum replicated the input batch_size times (2**40 copies: MemoryError)
    x = torch.randn(2, 3, 24, 40, generator=torch.Generator().manual_seed(1))
    ex = vx.Explainer(vit)
    one = ex.explain(x, method="occlusion", batch_size=1).maps
    torch.testing.assert_close(ex.explain(x, method="occlusion", batch_size=2**40).maps, one)
    torch.testing.assert_close(ex.explain(x, method="occlusion", batch_size=2**63).maps, one)
