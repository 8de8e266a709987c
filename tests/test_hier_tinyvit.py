"""timm TinyViT (an MBConv stage, then window-attention stages): the hierarchical family.

Oracles, built here without vitexplain's resampling code: the attention probabilities and dy/dA of an eager
float64 copy (tests/hier_oracle.py: every softmax it computes), placed on the grid by TinyViT's own window
code (zero-pad bottom / right, view, transpose) run on token indices (-1: padding, dropped), the patch
embedding's and ``PatchMerging``'s strided convs as average-pooling footprints, rollout / Chefer's rule as
dense products at every stage; CDAM against central differences of the model's output when a token entering
a stage's last attention (the output of the norm inside it, in its window slot) is scaled; a batch against
its images one by one. Windows of 3 on grids 8, 4 and 2 are all padded.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitexplain as vx
from hier_oracle import (BATCH_CASES, assert_batch_equals_images_alone, assert_stages_match_oracle, DenseCall,
                         pool_matrix, scatter_windows, taped_attention)

timm = pytest.importorskip("timm")

SIZE = (64, 64)
CLASSES = 5
GRIDS = [(16, 16), (8, 8), (4, 4), (2, 2)]


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model("tiny_vit_5m_224", pretrained=False, num_classes=CLASSES, embed_dims=(16, 32, 48, 64),
                              depths=(1, 2, 1, 2), num_heads=(1, 2, 2, 4), window_sizes=(3, 3, 3, 3)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "attention_biases", None), nn.Parameter):
                module.attention_biases.normal_(0, 1)
                module.attention_bias_cache = {}
            if isinstance(module, nn.Linear) and module.out_features == CLASSES:
                module.weight.normal_(0, 0.5)
    return model


def _slots(grid, ws):
    """(nW, ws * ws) grid index of each window slot (-1: padding): TinyVitBlock's pad and partition on indices."""
    h, w = grid
    idx = torch.arange(h * w, dtype=torch.float64).view(1, h, w, 1)
    pad_b, pad_r = (ws - h % ws) % ws, (ws - w % ws) % ws
    idx = F.pad(idx + 1, (0, 0, 0, pad_r, 0, pad_b)) - 1  # padding -> -1
    nh, nw = (h + pad_b) // ws, (w + pad_r) // ws
    return idx.view(1, nh, ws, nw, ws, 1).transpose(2, 3).reshape(nh * nw, ws * ws).long()


def _out(grid, conv):
    k, s, p = conv.kernel_size, conv.stride, conv.padding
    return tuple((grid[i] + 2 * p[i] - k[i]) // s[i] + 1 for i in range(2))


def dense_chain(model, x, target):
    taped = iter(taped_attention(model, x, target))
    grid = SIZE
    for conv in (model.patch_embed.conv1.conv, model.patch_embed.conv2.conv):
        grid = _out(grid, conv)
    b = x.shape[0]
    items, starts = [], []
    for s, stage in enumerate(model.stages):
        if s > 0:
            conv = stage.downsample.conv2.conv
            items.append(pool_matrix(grid, conv.kernel_size, conv.stride, conv.padding))
            grid = _out(grid, conv)
        starts.append(len(items))
        if s == 0:
            continue  # MBConv blocks
        n = grid[0] * grid[1]
        for block in stage.blocks:
            a, g = next(taped)
            idx = _slots(grid, block.window_size)
            a, g = (t.reshape(b, idx.shape[0], *t.shape[1:]) for t in (a, g))
            eye = torch.eye(n, dtype=torch.float64)
            items.append(DenseCall(scatter_windows(a, idx, idx, n, n), scatter_windows(g, idx, idx, n, n), eye, eye))
    assert next(taped, None) is None
    n = grid[0] * grid[1]
    return items, starts, torch.full((b, n), 1.0 / n, dtype=torch.float64)


def test_tinyvit_attention_methods_match_the_dense_float64_oracle():
    model = build()
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    items, starts, u = dense_chain(model, x, target=1)
    ex = vx.Explainer(model)
    assert ex.family == "hier" and ex.adapter.layout(SIZE).grid == GRIDS[0]
    assert_stages_match_oracle(ex, x, items, u, starts, GRIDS)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tinyvit_cdam_at_each_attention_stage_matches_finite_differences(stage):
    """S_(i,j) = d/de y when token (i, j) of the attention's normed input (its own ``norm``, inside the padded
    windows) is scaled by (1 + e)."""
    model = build().double()
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    e = vx.Explainer(model).explain(x, method="cdam", target=2, stage=stage)
    assert e.maps.shape == (1, *GRIDS[stage])
    last = len(model.stages[stage].blocks) - 1
    module = model.get_submodule(f"stages.{stage}.blocks.{last}.attn.norm")
    ws = model.stages[stage].blocks[last].window_size
    idx = _slots(GRIDS[stage], ws)
    numeric = torch.zeros(GRIDS[stage], dtype=torch.float64)
    for t in range(GRIDS[stage][0] * GRIDS[stage][1]):
        window, slot = (int(v) for v in (idx == t).nonzero()[0])
        numeric.view(-1)[t] = _window_derivative(module, window, slot, lambda: model(x)[0, 2])
    assert float(numeric.abs().max()) > 0
    torch.testing.assert_close(e.maps[0].double(), numeric, atol=1e-6 + 1e-5 * float(numeric.abs().max()), rtol=1e-5)


def _window_derivative(module, window, slot, score, eps=1e-5):
    """d score / de when slot ``slot`` of window ``window`` of the module's (nW, n, C) output (a batch of one) is
    scaled by (1 + e): a central difference."""
    def at(step):
        def scale(mod, inputs, out):
            out = out.clone()
            out[window, slot] *= 1 + step
            return out

        handle = module.register_forward_hook(scale)
        try:
            with torch.no_grad():
                return float(score())
        finally:
            handle.remove()

    return (at(eps) - at(-eps)) / (2 * eps)


def test_tinyvit_conv_stage_refuses_the_token_methods_and_a_batch_equals_its_images_one_by_one():
    ex = vx.Explainer(build(seed=1))
    x = torch.randn(3, 3, *SIZE, generator=torch.Generator().manual_seed(4))
    for method in ("cdam", "gradcam"):
        with pytest.raises(vx.UnsupportedMethodError, match=r"stage 0 .*\[1, 2, 3\]"):
            ex.explain(x, method=method, target=1, stage=0)
    assert_batch_equals_images_alone(ex, x, BATCH_CASES + (("cdam", {"stage": 1}), ("gradcam", {"stage": 1})))
