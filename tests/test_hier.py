"""Hierarchical transformers (PVTv2, Twins, SAM's ViT): the footprint rule against dense float64
oracles built in the test (tests/hier_oracle.py), CDAM against finite differences, batches
against single images, and maps on the grid ``e.layout`` says."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitexplain as vx
from hier_oracle import (DenseCall, adaptive_matrix, assert_matches_oracle, carry, eager_attention, pool_matrix, scatter_windows, token_derivative,
                         unfuse_all)

timm = pytest.importorskip("timm")
from timm.models.vision_transformer_sam import window_partition as sam_partition  # noqa: E402

SIZE = (64, 64)
CLASSES = 5

KINDS = {
    "pvt": ("pvt_v2_b0", dict(depths=(1, 2, 1, 1), embed_dims=(16, 32, 48, 64), num_heads=(1, 2, 2, 4))),
    "pvt_linear": ("pvt_v2_b2_li", dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 48, 64), num_heads=(1, 2, 2, 4))),
    "pcpvt": ("twins_pcpvt_small", dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 48, 64), num_heads=(1, 2, 2, 4),
                                        img_size=64)),
    "svt": ("twins_svt_small", dict(depths=(1, 1, 2, 1), embed_dims=(16, 32, 48, 64), num_heads=(1, 2, 2, 4),
                                    wss=[5, 5, 5, 5], img_size=64)),
    "sam": ("samvit_base_patch16", dict(img_size=64, depth=3, embed_dim=32, num_heads=2, global_attn_indexes=(1,),
                                        window_size=3, neck_chans=16)),
}


def build(kind: str) -> nn.Module:
    name, kwargs = KINDS[kind]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs).eval()
    with torch.no_grad():  # random heads are tiny; make the classes differ
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.out_features == CLASSES:
                module.weight.normal_(0, 0.5)
    return model


def images(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, *SIZE, generator=torch.Generator().manual_seed(seed))


def _conv_out(g, conv):
    k, s, p = conv.kernel_size, conv.stride, conv.padding
    return tuple((g[i] + 2 * p[i] - k[i]) // s[i] + 1 for i in range(2))


def _sr(attn, grid):
    if getattr(attn, "pool", None) is not None:
        return adaptive_matrix(grid, attn.pool.output_size if isinstance(attn.pool.output_size, tuple)
                               else (attn.pool.output_size,) * 2)
    sr = getattr(attn, "sr", None)
    if sr is None:
        return torch.eye(grid[0] * grid[1], dtype=torch.float64)
    return pool_matrix(grid, sr.kernel_size, sr.stride, sr.padding)


def _full(a, g):
    return a.double()  # (B, H, N, N_k): one window holding every token


def dense_chain(kind: str, model: nn.Module, x: torch.Tensor, target: int) -> tuple[list, list[int]]:
    """The dense oracle chain and the index of each stage's first item."""
    if kind.startswith("pvt"):
        names = [f"stages.{s}.blocks.{b}.attn" for s, st in enumerate(model.stages) for b in range(len(st.blocks))]
    elif kind in ("pcpvt", "svt"):
        names = [f"blocks.{s}.{b}.attn" for s, st in enumerate(model.blocks) for b in range(len(st))]
    else:
        names = [f"blocks.{b}.attn" for b in range(len(model.blocks))]
    seen = iter(eager_attention(model, x, target, names, unfuse_all))
    items, starts = [], []
    b = x.shape[0]
    if kind.startswith("pvt"):
        grid = _conv_out(SIZE, model.patch_embed.proj)
        for s, stage in enumerate(model.stages):
            if s > 0:
                conv = stage.downsample.proj
                items.append(pool_matrix(grid, conv.kernel_size, conv.stride, conv.padding))
                grid = _conv_out(grid, conv)
            starts.append(len(items) - (1 if s > 0 else 0) + (1 if s > 0 else 0))
            for block in stage.blocks:
                a, g = next(seen)
                n = grid[0] * grid[1]
                items.append(DenseCall(a.double(), g.double(), _sr(block.attn, grid), torch.eye(n, dtype=torch.float64)))
    elif kind in ("pcpvt", "svt"):
        grid = SIZE
        for s, (embed, blocks) in enumerate(zip(model.patch_embeds, model.blocks)):
            new = _conv_out(grid, embed.proj)
            if s > 0:
                items.append(pool_matrix(grid, embed.proj.kernel_size, embed.proj.stride, embed.proj.padding))
            grid = new
            starts.append(len(items))
            n = grid[0] * grid[1]
            for block in blocks:
                a, g = next(seen)
                if type(block.attn).__name__ == "LocallyGroupedAttn":
                    ws = block.attn.ws
                    idx = torch.arange(n).view(1, *grid, 1)  # the model's own padding and reshape
                    hp, wp = -(-grid[0] // ws) * ws, -(-grid[1] // ws) * ws
                    idx = torch.nn.functional.pad(idx + 1, (0, 0, 0, wp - grid[1], 0, hp - grid[0])) - 1
                    idx = idx.reshape(1, hp // ws, ws, wp // ws, ws, 1).transpose(2, 3).reshape(-1, ws * ws)
                    a = scatter_windows(a, idx, idx, n, n)
                    g = scatter_windows(g, idx, idx, n, n)
                    keys = torch.eye(n, dtype=torch.float64)
                else:
                    keys = _sr(block.attn, grid)
                items.append(DenseCall(a.double(), g.double(), keys, torch.eye(n, dtype=torch.float64)))
    else:
        grid = (SIZE[0] // 16, SIZE[1] // 16)
        n = grid[0] * grid[1]
        starts.append(0)
        for block in model.blocks:
            a, g = next(seen)
            heads = block.attn.num_heads
            if block.window_size > 0:
                idx, _ = sam_partition((torch.arange(n) + 1).view(1, *grid, 1).double(), block.window_size)
                idx = idx.reshape(idx.shape[0], -1).long() - 1
                a = a.reshape(b, idx.shape[0], heads, *a.shape[-2:])
                g = g.reshape(b, idx.shape[0], heads, *g.shape[-2:])
                a, g = scatter_windows(a, idx, idx, n, n), scatter_windows(g, idx, idx, n, n)
            else:
                a, g = a.reshape(b, heads, n, n), g.reshape(b, heads, n, n)
            items.append(DenseCall(a, g, torch.eye(n, dtype=torch.float64), torch.eye(n, dtype=torch.float64)))
        for layer in model.neck:
            if isinstance(layer, nn.Conv2d) and layer.kernel_size != (1, 1):
                items.append(pool_matrix(grid, layer.kernel_size, layer.stride, layer.padding))
    return items, starts


def _last_n(items) -> int:
    last = items[-1]
    return last.shape[0] if isinstance(last, torch.Tensor) else last.probs.shape[2]


@pytest.mark.parametrize("kind", list(KINDS))
def test_attention_methods_match_the_dense_float64_oracle(kind):
    model = build(kind)
    x = images()
    target = 1
    items, starts = dense_chain(kind, model, x, target)
    ex = vx.Explainer(model)
    assert ex.family == "hier"
    n_last = _last_n(items)
    u = torch.full((x.shape[0], n_last), 1.0 / n_last, dtype=torch.float64)
    for method, mode in (("rollout", "rollout"), ("generic", "generic"), ("grad_rollout", "grad_rollout")):
        e = ex.explain(x, method=method, target=target)
        want = carry(items, u, mode).view(x.shape[0], *e.maps.shape[1:])
        assert_matches_oracle(e.maps, want, method)  # float32 against float64
        assert tuple(e.maps.shape[1:]) == e.layout.grid and e.maps.shape[0] == x.shape[0]
    # the last stage's grid: the oracle's product from that stage's first item on
    e = ex.explain(x, method="rollout", stage=-1)
    want = carry(items, u, "rollout", start=starts[-1]).view(x.shape[0], *e.maps.shape[1:])
    assert float((e.maps.double() - want).abs().max()) <= 1e-5
    assert tuple(e.maps.shape[1:]) == e.layout.grid


@pytest.mark.parametrize("kind", ["pvt", "svt", "sam"])
def test_a_batch_equals_its_images_one_by_one(kind):
    model = build(kind)
    x = images(3, seed=2)
    ex = vx.Explainer(model)
    for method, options in (("rollout", {}), ("generic", {}), ("cdam", {}), ("cdam", {"stage": 0}), ("raw", {})):
        together = ex.explain(x, method=method, target=2, **options).maps
        alone = torch.cat([ex.explain(x[i:i + 1], method=method, target=2, **options).maps for i in range(3)])
        assert together.shape[0] == 3
        torch.testing.assert_close(together, alone, atol=1e-5 * float(alone.abs().max()) + 1e-9, rtol=1e-4)


@pytest.mark.parametrize("kind,stage", [("pvt", -1), ("pvt", 1), ("sam", 0)])
def test_cdam_matches_finite_differences(kind, stage):
    """S_i = d/de y when token i entering the stage's last attention is scaled by (1 + e)."""
    model = build(kind).double()
    x = images(1, seed=3).double()
    ex = vx.Explainer(model)
    e = ex.explain(x, method="cdam", target=0, stage=stage)
    site = ex.adapter.token_sites[stage]
    module = model.get_submodule(site)
    grid = e.maps.shape[1:]
    picks = torch.randperm(grid[0] * grid[1], generator=torch.Generator().manual_seed(0))[:4].tolist()
    for flat in picks:
        i, j = divmod(flat, grid[1])
        numeric = token_derivative(module, lambda out: (i, j) if out.dim() == 4 else (flat,),  # cells or positions
                                   lambda: model(x)[0, 0])
        assert abs(float(e.maps[0, i, j]) - numeric) <= 1e-6 + 1e-5 * abs(numeric), (flat, numeric)


def test_stage_option_and_layout_for_every_method():
    model = build("pvt")
    ex = vx.Explainer(model)
    x = images(2)
    grids = [s.grid for s in ex.adapter.stage_sets(SIZE)]
    assert grids == [(16, 16), (8, 8), (4, 4), (2, 2)]
    for method in ("rollout", "generic", "grad_rollout", "cdam", "gradcam"):
        for stage in range(len(grids)):
            e = ex.explain(x, method=method, stage=stage)
            assert e.maps.shape == (2, *grids[stage]) and e.layout.grid == grids[stage]
            assert e.layout.patch_size == (SIZE[0] // grids[stage][0], SIZE[1] // grids[stage][1])
    with pytest.raises(vx.OptionError, match="stage"):
        ex.explain(x, method="rollout", stage=4)
    e = ex.explain(x, method="rollout")
    torch.testing.assert_close(e.maps.sum(dim=(1, 2)), torch.ones(2), atol=1e-5, rtol=0)  # a distribution
    assert e.maps.min() >= 0


def test_layout_says_the_grid_and_the_pixels_a_cell_covers():
    """A Swin map on stage 0 has the stage-0 grid in e.layout (the layout used to say the last
    stage's); a hybrid-stem ViT (vitamin) says 16 px per token, not its patch embedding's 1 px."""
    torch.manual_seed(0)
    vitamin = timm.create_model("vitamin_small_224", pretrained=False, num_classes=CLASSES, depth=1, img_size=64).eval()
    assert vx.token_layout(vitamin, 64).patch_size == (16, 16)
    e = vx.Explainer(vitamin).explain(images(1), method="rollout")
    assert e.maps.shape == (1, 4, 4) and e.layout.grid == (4, 4) and e.layout.patch_size == (16, 16)
    from timm.models.swin_transformer import SwinTransformer

    swin = SwinTransformer(img_size=64, patch_size=4, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4),
                           num_classes=CLASSES).eval()
    ex = vx.Explainer(swin)
    for stage, grid in ((0, (16, 16)), (1, (8, 8))):
        e = ex.explain(images(2), method="rollout", stage=stage)
        assert e.maps.shape == (2, *grid) and e.layout.grid == grid and e.layout.patch_size == (64 // grid[0],) * 2


def test_methods_not_defined_across_stages_are_refused_with_the_reason():
    ex = vx.Explainer(build("pvt"))
    with pytest.raises(vx.UnsupportedMethodError, match="is a hier model.*it is not offered"):
        ex.explain(images(1), method="attn_gradcam")
    # legrad runs on the last stage's blocks (tests/test_hier_legrad.py); an earlier stage's are refused
    with pytest.raises(vx.UnsupportedMethodError, match="only the last stage's attention calls.*'generic'"):
        ex.explain(images(1), method="legrad", layers=[0])


@pytest.mark.parametrize("dense_limit", [0, 2**30])  # through D's entries / as one dense GEMM
def test_footprint_pull_equals_pooling_matrix_either_way(monkeypatch, dense_limit):
    """``r @ D`` of a footprint, both ways Footprint.pull computes it, against the pooling matrix of
    avg_pool2d (count_include_pad=False) / adaptive_avg_pool2d of one-hot images (hier_oracle)."""
    from vitexplain.methods import footprint as fp

    monkeypatch.setattr(fp, "DENSE_PULL_ENTRIES", dense_limit)
    cases = [  # (fine grid, coarse grid, kernel, stride, padding, prefix), or None for adaptive
        ((9, 7), (5, 4), 3, 2, 1, 0),       # overlapping conv, padded edges
        ((8, 8), (2, 2), 4, 4, 0, 1),       # non-overlapping, a class token kept
        ((7, 5), (3, 2), (3, 2), (2, 2), 0, 0),
        ((10, 6), (3, 4), None, None, None, 0),
    ]
    torch.manual_seed(1)
    for fine, coarse, kernel, stride, padding, prefix in cases:
        fine_set, coarse_set = fp.TokenSet(prefix, fine), fp.TokenSet(prefix, coarse)
        if kernel is None:
            footprint, expected = fp.Footprint.adaptive(fine_set, coarse_set), adaptive_matrix(fine, coarse)
        else:
            footprint = fp.Footprint.pool(fine_set, coarse_set, kernel, stride, padding)
            expected = pool_matrix(fine, kernel, stride, padding, prefix)
        assert expected.shape == (coarse_set.n, fine_set.n)
        r = torch.rand(3, coarse_set.n, dtype=torch.float64)
        torch.testing.assert_close(footprint.pull(r), r @ expected, rtol=1e-12, atol=1e-12)
        r32 = r.float()
        torch.testing.assert_close(footprint.pull(r32), (r @ expected).float(), rtol=1e-6, atol=1e-7)


def test_sam_refuses_a_size_its_patch_does_not_divide_naming_its_patch_and_a_size_that_fits():
    """SAM's ViT takes any multiple of its 16 px patch (its position embedding is resampled): a 60 px input is
    refused with that patch size and a multiple to use, not the 60 / 3 = 20 px a 3 x 3 grid's cells would
    cover, nor 60 px itself."""
    ex = vx.Explainer(build("sam"))
    with pytest.raises(vx.InputError, match=r"its patch size 16x16 must divide the input.*e\.g\. 48x48"):
        ex.explain(torch.randn(1, 3, 60, 60), method="rollout", target=1)
    assert ex.adapter.layout((60, 60)).patch_size == ex.adapter.layout((48, 48)).patch_size == (16, 16)


def test_raw_reads_each_head_of_a_call_whose_heads_are_folded_into_its_batch():
    """SAM calls SDPA on (B * windows * heads, n, d): its record has one "head". raw's ``head`` option counts
    the model's heads (2 here), negative from the last, each the mean over the call's queries of that head's
    attention (oracle: the eager copy's per-head softmax, windows scattered), and refuses a third."""
    model = build("sam")
    x = images()
    items, _ = dense_chain("sam", model, x, 1)
    ex = vx.Explainer(model)
    for layer in (0, 1):  # windowed, global
        probs = items[layer].probs  # (B, 2, n, n)
        for head in (0, 1, -1):
            e = ex.explain(x, method="raw", target=1, layer=layer, head=head)
            want = probs[:, head].mean(dim=1).view(x.shape[0], *e.maps.shape[1:])
            assert_matches_oracle(e.maps, want, (layer, head))
    with pytest.raises(vx.OptionError, match=r"'head' must be in \[-2, 1\].*2 heads"):
        ex.explain(x, method="raw", layer=0, head=2)


def test_gradient_methods_run_inside_no_grad_and_are_refused_clearly_inside_inference_mode():
    """Inference code often runs under torch.no_grad(): explain enables gradients where its methods need them,
    so the maps equal those explained outside it (the backward used to fail with torch's raw 'element 0 of
    tensors does not require grad'). torch.inference_mode() cannot be overridden: a UsageError says so."""
    ex = vx.Explainer(build("svt"))
    x = images()
    for method in ("generic", "cdam", "grad_rollout", "rollout"):
        want = ex.explain(x, method=method, target=1).maps
        with torch.no_grad():
            got = ex.explain(x, method=method, target=1).maps
        torch.testing.assert_close(got, want)
    with torch.inference_mode(), pytest.raises(vx.UsageError, match=r"inference_mode.*outside"):
        ex.explain(x, method="generic", target=1)
    with torch.inference_mode():  # no gradient needed: it runs
        assert ex.explain(x, method="rollout", target=1).maps.shape == (2, 16, 16)
