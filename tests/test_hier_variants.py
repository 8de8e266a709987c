"""Variants of the hierarchical families that the support table's one build per family does not cover (other
heads, sizes, stems), each at a promise a user relies on: a batch equals its images one by one, maps on the grid
the layout says."""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
from support_table import _levit_gains, reinit_heads

timm = pytest.importorskip("timm")

_LEVIT = dict(embed_dim=(32, 48, 64), key_dim=8, depth=(1, 1, 1), num_heads=(2, 2, 2), num_classes=5)


def _levit(distilled: bool, size: int):
    """A tiny timm LeViT in token mode (its stem's last BatchNorm2d feeds ``x.flatten(2).transpose(1, 2)``)."""
    from timm.models.levit import Levit, LevitDistilled

    torch.manual_seed(0)
    model = _levit_gains((LevitDistilled if distilled else Levit)(img_size=size, **_LEVIT)).eval()
    reinit_heads(model, 0)
    return model


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("distilled,size", [(False, 128), (True, 96)])
def test_levit_lrp_of_one_image_equals_its_row_of_a_batch(method, distilled, size):
    """PyTorch's eval BatchNorm2d backward is wrong for a channels-last gradient of a contiguous input, what a batch
    of one gets back through LeViT's ``flatten(2).transpose(1, 2)``; the LRP rules hand it a contiguous gradient.
    (Before: AttnLRP of one image differed from its row of a batch by 1.4-2.4 times the map's largest value.)"""
    model = _levit(distilled, size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    ex = vx.Explainer(model)
    whole = ex.explain(x, method=method, target=[1, 3])
    for i, target in enumerate([1, 3]):
        alone = ex.explain(x[i:i + 1], method=method, target=target)
        scale = float(whole.maps[i].abs().max())
        assert scale > 0
        assert float((alone.maps[0] - whole.maps[i]).abs().max()) <= 1e-5 * scale, (method, i)
        torch.testing.assert_close(alone.extras["conservation"][0], whole.extras["conservation"][i], rtol=1e-4,
                                   atol=1e-6)


@pytest.mark.parametrize("method,options", [("integrated_gradients", {"steps": 4}),
                                            ("smoothgrad", {"samples": 2, "seed": 3})])
def test_levit_input_gradients_do_not_depend_on_how_many_inputs_a_forward_takes(method, options):
    """captum's ``batch_size`` (IG's steps, SmoothGrad's noisy copies per forward) only splits the work: with
    ``batch_size=1`` every forward is a batch of one, whose gradient met the same BatchNorm backward error (before:
    off by 2.5x (IG) and 0.8x (SmoothGrad) of the map's largest value)."""
    model = _levit(False, 128)
    x = torch.randn(1, 3, 128, 128, generator=torch.Generator().manual_seed(1))
    ex = vx.Explainer(model)
    together = ex.explain(x, method=method, target=1, **options).maps
    one_by_one = ex.explain(x, method=method, target=1, batch_size=1, **options).maps
    scale = float(together.abs().max())
    assert scale > 0
    assert float((one_by_one - together).abs().max()) <= 1e-5 * scale
