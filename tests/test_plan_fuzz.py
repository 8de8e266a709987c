"""What fuzzing the one plan found: each listed method runs or refuses with a vitexplain error on
models, sizes and options the other tests do not use, and its options are not taken blindly."""

from __future__ import annotations

import pytest
import timm
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


@pytest.mark.parametrize("build, size", [
    # built for 64 px (attention biases for a 2 x 2 grid) and given 64 x 96
    (lambda: timm.models.efficientformer_v2.EfficientFormerV2(
        depths=(1, 1, 2, 2), embed_dims=(16, 24, 32, 48), img_size=64, num_vit=2, num_classes=5), (64, 96)),
    # timm's config: a fixed 224 x 224 input
    (lambda: timm.create_model("efficientformer_l1", pretrained=False, num_classes=5), (160, 160)),
])
def test_a_hybrid_built_for_one_size_refuses_another_with_an_input_error(build, size):
    # its attention keeps position biases for one grid: another size fails inside the model
    # (a raw RuntimeError 'shape ... is invalid'); a user is told it is the input size
    model = build().eval()
    ex = vx.Explainer(model)
    assert ex.family.name == "cnn"
    with pytest.raises(vx.InputError, match=rf"does not take a {size[0]}x{size[1]} input .*size it was built for"):
        ex.explain(torch.randn(1, 3, *size), method="gradcam")
