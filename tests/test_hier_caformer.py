"""timm CAFormer (``MetaFormer``: separable-conv stages, then global-attention stages): the hierarchical family.

Oracles, built here without vitexplain's resampling code: the attention probabilities and dy/dA of an eager
float64 copy (tests/hier_oracle.py: every softmax it computes), the stem's and downsamples' strided convs as
average-pooling footprints, rollout / Chefer's rule as dense products at every stage; CDAM at each attention
stage against central differences of the model's output when a token entering the stage's last attention is
scaled; a batch against its images one by one. Conv stages refuse the token methods; ConvFormer (no attention)
stays a CNN.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitexplain as vx
from hier_oracle import (BATCH_CASES, assert_batch_equals_images_alone, assert_stages_match_oracle, DenseCall,
                         pool_matrix, taped_attention, token_derivative)

timm = pytest.importorskip("timm")

SIZE = (64, 64)
CLASSES = 5
GRIDS = [(16, 16), (8, 8), (4, 4), (2, 2)]


def build(seed: int = 0, name: str = "caformer_s18", dims: tuple = (16, 32, 64, 96)) -> nn.Module:
    """A tiny ``name``: grids 16, 8 (conv stages), 4, 2 (attention stages: two blocks, two and three heads of 32) at 64 px; timm downsamples only where the width changes."""
    from timm.models.metaformer import Attention, LayerNorm2dNoBias, LayerNormNoBias, MetaFormer, SepConv

    torch.manual_seed(seed)
    if name == "convformer_s18":  # timm's convformer_s18 config, smaller
        return MetaFormer(depths=(1, 1, 2, 2), dims=(16, 32, 48, 64), token_mixers=SepConv,
                          num_classes=CLASSES).eval()
    return MetaFormer(depths=(1, 1, 2, 2), dims=dims, token_mixers=[SepConv, SepConv, Attention, Attention],
                      norm_layers=[LayerNorm2dNoBias] * 2 + [LayerNormNoBias] * 2, num_classes=CLASSES).eval()


def _out(grid, conv):
    k, s, p = conv.kernel_size, conv.stride, conv.padding
    return tuple((grid[i] + 2 * p[i] - k[i]) // s[i] + 1 for i in range(2))


def dense_chain(model, x, target):
    """(items, index of each stage's first item, readout row); first grid: the stem's."""
    taped = iter(taped_attention(model, x, target))
    grid = _out(SIZE, model.stem.conv)
    items, starts = [], []
    for stage in model.stages:
        if not isinstance(stage.downsample, nn.Identity):
            conv = stage.downsample.conv
            items.append(pool_matrix(grid, conv.kernel_size, conv.stride, conv.padding))
            grid = _out(grid, conv)
        starts.append(len(items))
        n = grid[0] * grid[1]
        for block in stage.blocks:
            if type(block.token_mixer).__name__ == "Attention":
                a, g = next(taped)
                eye = torch.eye(n, dtype=torch.float64)
                items.append(DenseCall(a, g, eye, eye))
    assert next(taped, None) is None
    n = grid[0] * grid[1]
    return items, starts, torch.full((x.shape[0], n), 1.0 / n, dtype=torch.float64)


@pytest.mark.parametrize("dims", [(16, 32, 64, 96), (16, 16, 64, 64)])
def test_caformer_attention_methods_match_the_dense_float64_oracle(dims):
    """Also with repeated widths: timm then leaves a stage's downsample out (the grid stays)."""
    model = build(dims=dims)
    grids = GRIDS if dims[1] != dims[0] else [GRIDS[0], GRIDS[0], GRIDS[1], GRIDS[1]]
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    items, starts, u = dense_chain(model, x, target=1)
    ex = vx.Explainer(model)
    assert ex.family == "hier" and ex.adapter.layout(SIZE).grid == GRIDS[0]
    assert_stages_match_oracle(ex, x, items, u, starts, grids)


@pytest.mark.parametrize("stage", [2, 3])
def test_caformer_cdam_at_each_attention_stage_matches_finite_differences(stage):
    model = build().double()
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    e = vx.Explainer(model).explain(x, method="cdam", target=2, stage=stage)
    assert e.maps.shape == (1, *GRIDS[stage])
    module = model.get_submodule(f"stages.{stage}.blocks.1.norm1")
    n = GRIDS[stage][0] * GRIDS[stage][1]
    numeric = torch.tensor([token_derivative(module, (t,), lambda: model(x)[0, 2]) for t in range(n)],
                           dtype=torch.float64).reshape(GRIDS[stage])
    assert float(numeric.abs().max()) > 0
    torch.testing.assert_close(e.maps[0].double(), numeric, atol=1e-6 + 1e-5 * float(numeric.abs().max()), rtol=1e-5)


def test_caformer_conv_stages_refuse_the_token_methods_and_a_batch_equals_its_images_one_by_one():
    ex = vx.Explainer(build(seed=1))
    x = torch.randn(3, 3, *SIZE, generator=torch.Generator().manual_seed(4))
    for method in ("cdam", "gradcam"):
        with pytest.raises(vx.UnsupportedMethodError, match=r"stage 1 .*\[2, 3\]"):
            ex.explain(x, method=method, target=1, stage=1)
    assert_batch_equals_images_alone(ex, x, BATCH_CASES + (("cdam", {"stage": 2}), ("gradcam", {"stage": 2})))


def test_convformer_without_attention_stays_a_cnn():
    ex = vx.Explainer(build(name="convformer_s18"))
    assert ex.family == "cnn" and "gradcam" in ex.methods()
