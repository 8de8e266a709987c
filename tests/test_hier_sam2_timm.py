"""timm ``HieraDet`` (SAM 2's Hiera, ``sam2_hiera_*``): the footprint rule against a dense float64 oracle
built here from an eager float64 copy's own softmax outputs (tests/hier_oracle.py), with the windows read
from timm's own ``window_partition`` / ``window_unpartition`` on token indices; CDAM against finite
differences; a batch against its images one by one; the pretrained-size build recognised.

The tiny model at 64 px has grids 16 x 16, 8 x 8 and 4 x 4: windows of 4 (block 0), queries pooled in windows
of 4 -> 2 (block 1), windows of 2 (block 2), queries pooled in windows of 2 -> 1 (block 3), zero-padded windows
of 3 on the 4 x 4 grid (block 4), global attention (block 5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitexplain as vx
from hier_oracle import taped_attention, token_derivative
from sam2_checks import GRIDS, check_batch_equals_one_by_one, check_dense_oracle, dense_calls

timm = pytest.importorskip("timm")
hieradet = pytest.importorskip("timm.models.hieradet_sam2")

SIZE = (64, 64)


def tiny() -> nn.Module:
    """A random-init HieraDet with every weight matrix N(0, 1 / fan_in) (timm's init makes the attention
    near uniform) and a 5-class head."""
    torch.manual_seed(0)
    model = hieradet.HieraDet(embed_dim=16, num_heads=1, stages=(1, 2, 3), q_pool=2, window_spec=(4, 2, 3),
                              global_att_blocks=(5,), global_pos_size=(4, 4), num_classes=5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / p[0].numel() ** 0.5)
    return model.eval()


def _partition_index(grid, window):
    """(nW, wh * ww) grid index of each window slot, -1 = padding: the block's padding and timm's
    window_partition on token indices (+1, so padding reads 0)."""
    n = grid[0] * grid[1]
    idx = (torch.arange(n) + 1).view(1, *grid, 1).double()
    pad_h, pad_w = (-grid[0]) % window[0], (-grid[1]) % window[1]
    idx = F.pad(idx, (0, 0, 0, pad_w, 0, pad_h))
    return hieradet.window_partition(idx, window).reshape(-1, window[0] * window[1]).round().long() - 1


def _unpartition_index(coarse, window, windows):
    """(nW, wh * ww) coarse-grid index of each pooled query slot, -1 = cropped: timm's window_unpartition
    of slot numbers, then the block's crop."""
    padded = tuple(g + (-g) % w for g, w in zip(coarse, window))
    slots = (torch.arange(windows * window[0] * window[1]) + 1).double().view(windows, *window, 1)
    placed = hieradet.window_unpartition(slots, window, padded)[:, :coarse[0], :coarse[1]].reshape(-1).round().long() - 1
    index = torch.full((windows * window[0] * window[1],), -1, dtype=torch.long)
    index[placed] = torch.arange(placed.numel())
    return index.view(windows, -1)


def dense(model, x, target):
    """Dense calls on each stage's row-major grid, forward order; the last grid."""
    return dense_calls(taped_attention(model, x, target), model.blocks, x.shape[0], lambda b: tuple(b.window_size),
                       lambda b: bool(b.q_stride), _partition_index, _unpartition_index)


def test_hieradet_matches_the_dense_float64_oracle():
    model = tiny()
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    items, grid = dense(model, x, 1)
    ex = vx.Explainer(model)
    assert ex.family == "hier" and type(ex.adapter).__name__ == "TimmHieraDetAdapter"
    assert {"rollout", "generic", "grad_rollout", "raw", "cdam"} <= set(ex.methods())
    check_dense_oracle(ex, x, items, grid, 1)


def test_hieradet_batch_equals_its_images_one_by_one():
    model = tiny()
    x = torch.randn(3, 3, *SIZE, generator=torch.Generator().manual_seed(2))
    check_batch_equals_one_by_one(vx.Explainer(model), x, 2)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_hieradet_cdam_matches_finite_differences(stage):
    """S_(i,j) = d/de logit when token (i, j) of the (B, H, W, C) tokens entering the last attention reading
    the stage's grid is scaled by (1 + e): block 1's norm1 (it pools stage 0), block 3's, block 5's."""
    model = tiny().double()
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    e = vx.Explainer(model).explain(x, method="cdam", target=1, stage=stage)
    grid = GRIDS[stage]
    assert e.maps.shape == (1, *grid)
    module = model.get_submodule(f"blocks.{[1, 3, 5][stage]}.norm1")
    for t in torch.randperm(grid[0] * grid[1], generator=torch.Generator().manual_seed(0))[:8].tolist():
        i, j = divmod(t, grid[1])
        numeric = token_derivative(module, (i, j), lambda: model(x)[0, 1])
        got = float(e.maps[0, i, j])
        assert abs(got - numeric) <= 1e-6 + 1e-5 * abs(numeric), (t, got, numeric)


def test_timm_sam2_hiera_is_recognised_and_max_pooling_heads_are_refused():
    """The registered build at a size its windows tile (its smallest: 224 px; pretrained 896), and the
    global_pool='max' build's attention methods refused with the reason (the readout is no longer the
    tokens' mean); its token methods still apply."""
    model = timm.create_model("sam2_hiera_tiny", pretrained=False, num_classes=3).eval()
    ex = vx.Explainer(model)
    assert ex.family == "hier" and len(ex.adapter.token_sites) == 4
    e = ex.explain(torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(4)), method="rollout", target=0)
    assert e.maps.shape == (2, 56, 56) == (2, *e.layout.grid) and bool(torch.isfinite(e.maps).all())
    maxed = vx.Explainer(timm.create_model("sam2_hiera_tiny", pretrained=False, num_classes=3, global_pool="max"))
    assert "cdam" in maxed.methods() and "generic" not in maxed.methods()
    with pytest.raises(vx.UnsupportedMethodError, match=r"global_pool='max'.*mean of its last tokens"):
        maxed.plan(method="generic")


def test_hieradet_refuses_a_size_its_window_position_embedding_does_not_tile_and_takes_one_it_does():
    """HieraDet tiles its window position embedding (4 x 4 here) over the stage-0 token grid: at 60 px the
    15 x 15 grid does not tile, and timm fails with a shape error; vitexplain says which size to use. At
    80 px (a 20 x 20 grid) the model runs, and so does the explanation, on that grid."""
    ex = vx.Explainer(tiny())
    with pytest.raises(vx.InputError, match=r"does not take a 60x60 input .*expects \d+x\d+ images"):
        ex.explain(torch.randn(1, 3, 60, 60), method="rollout", target=1)
    e = ex.explain(torch.randn(1, 3, 80, 80), method="rollout", target=1)
    assert e.maps.shape == (1, 20, 20) == (1, *e.layout.grid)
