"""timm CoAtNet / CoAtNeXt (``MaxxVit`` with conv stages, then transformer stages): the hierarchical family.

Oracles, built here without vitexplain's resampling code: the attention probabilities and dy/dA of an eager
float64 copy of the model (tests/hier_oracle.py: every softmax it computes), each block's resampling read from
the module the model itself strides with (named per block type below) as an average-pooling footprint, and
rollout / Chefer's rule as dense products; CDAM at each transformer stage against central differences of the
model's output when a cell of the (B, C, H, W) map entering the stage's last attention is scaled; a batch
against its images one by one. Conv stages (no attention) are reached through their footprints only: the token
methods are refused there, with the reason.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import vitexplain as vx
from hier_oracle import (BATCH_CASES, assert_batch_equals_images_alone, assert_matches_oracle, carry, DenseCall,
                         pool_matrix, taped_attention, token_derivative)

timm = pytest.importorskip("timm")

SIZE = (64, 64)
CLASSES = 5
#: timm configs: MBConv blocks striding by a pooling (``stride_mode='pool'``), by their 3 x 3 depthwise conv
#: (``'dw'``), and ConvNeXt blocks (strided 7 x 7 depthwise conv); transformer stages pool 2 x 2.
KINDS = ("coatnet_nano_rw", "coatnet_bn_0_rw", "coatnext_nano_rw")


def build(kind: str, seed: int = 0) -> nn.Module:
    """A tiny ``kind``: grids 16, 8 (conv stages), 4, 2 (transformer stages) at 64 px."""
    from timm.models.maxxvit import MaxxVit, model_cfgs

    base = model_cfgs[kind]
    cfg = dataclasses.replace(base, embed_dim=(16, 16, 32, 32), depths=(1, 1, 2, 2), stem_width=(16, 16),
                              transformer_cfg=dataclasses.replace(base.transformer_cfg, dim_head=8))
    torch.manual_seed(seed)
    model = MaxxVit(cfg, img_size=SIZE, num_classes=CLASSES).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.out_features == CLASSES:
                module.weight.normal_(0, 0.5)
    return model


def _out(grid, module):
    k, s, p = (v if isinstance(v, (tuple, list)) else (v, v) for v in (module.kernel_size, module.stride, module.padding))
    return tuple((grid[i] + 2 * p[i] - k[i]) // s[i] + 1 for i in range(2))


def _resampler(block: nn.Module) -> nn.Module:
    """The module that strides the block's main path, by block type (timm's maxxvit.py); the identity-shaped
    ``block.shortcut`` (stride 1) for a block that does not stride."""
    kind = type(block).__name__
    if isinstance(block.shortcut, nn.Identity):
        return nn.AvgPool2d(1)
    if kind == "TransformerBlock2d":
        return block.norm1.down.pool  # the attention and the shortcut both read this pooling
    if kind == "ConvNeXtBlock":
        return block.conv_dw
    return block.down.pool if not isinstance(block.down, nn.Identity) else block.conv2_kxk  # MbConvBlock


def dense_chain(model: nn.Module, x: torch.Tensor, target: int):
    """(items, index of each stage's first item, readout row), first grid = stage 0's (after its strided block)."""
    taped = iter(taped_attention(model, x, target))
    grid = SIZE
    for conv in (model.stem.conv1, model.stem.conv2):
        grid = _out(grid, conv)
    items, starts, first = [], [], True
    for stage in model.stages:
        for i, block in enumerate(stage.blocks):
            down = _resampler(block)
            if down.stride not in (1, (1, 1)):
                if not first:
                    k, s, p = down.kernel_size, down.stride, down.padding
                    items.append(pool_matrix(grid, k, s, p))
                grid = _out(grid, down)
                first = False
            if i == 0:
                starts.append(len(items))
            if type(block).__name__ == "TransformerBlock2d":
                a, g = next(taped)
                n = grid[0] * grid[1]
                assert a.shape[-2:] == (n, n)
                eye = torch.eye(n, dtype=torch.float64)
                items.append(DenseCall(a, g, eye, eye))
    assert next(taped, None) is None
    n = grid[0] * grid[1]
    return items, starts, torch.full((x.shape[0], n), 1.0 / n, dtype=torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_coatnet_attention_methods_match_the_dense_float64_oracle(kind):
    model = build(kind)
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    items, starts, u = dense_chain(model, x, target=1)
    ex = vx.Explainer(model)
    assert ex.family == "hier" and ex.adapter.layout(SIZE).grid == (16, 16)
    for method in ("rollout", "generic", "grad_rollout"):
        for stage in (0, 1, 2, 3):
            if method == "rollout" and stage in (1, 3):
                continue
            e = ex.explain(x, method=method, target=1, stage=stage)
            want = carry(items, u, method, start=starts[stage]).reshape(e.maps.shape)
            assert e.maps.shape == (2, 16 >> stage, 16 >> stage)
            assert_matches_oracle(e.maps, want, (method, stage))


@pytest.mark.parametrize("stage", [2, 3])
def test_coatnet_cdam_at_each_transformer_stage_matches_finite_differences(stage):
    """S_(i,j) = d/de y when cell (i, j) of the map entering the stage's last attention (its last block's
    ``norm1`` output: pooled in a stage's first block) is scaled by (1 + e)."""
    model = build("coatnet_nano_rw").double()
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    e = vx.Explainer(model).explain(x, method="cdam", target=2, stage=stage)
    grid = (16 >> stage, 16 >> stage)
    assert e.maps.shape == (1, *grid)
    module = model.get_submodule(f"stages.{stage}.blocks.1.norm1")
    numeric = torch.tensor([[token_derivative(module, (slice(None), i, j), lambda: model(x)[0, 2])
                             for j in range(grid[1])] for i in range(grid[0])], dtype=torch.float64)
    assert float(numeric.abs().max()) > 0
    torch.testing.assert_close(e.maps[0].double(), numeric, atol=1e-6 + 1e-5 * float(numeric.abs().max()), rtol=1e-5)


def test_coatnet_conv_stages_refuse_the_token_methods_and_a_batch_equals_its_images_one_by_one():
    ex = vx.Explainer(build("coatnext_nano_rw", seed=1))
    x = torch.randn(3, 3, *SIZE, generator=torch.Generator().manual_seed(4))
    for method in ("cdam", "gradcam"):
        with pytest.raises(vx.UnsupportedMethodError, match=r"stage 0 .*\[2, 3\]"):
            ex.explain(x, method=method, target=1, stage=0)
    assert_batch_equals_images_alone(ex, x, BATCH_CASES + (("cdam", {"stage": 2}), ("gradcam", {"stage": 2})))
