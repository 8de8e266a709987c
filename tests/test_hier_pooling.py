"""Pooling transformers (PiT, MaxViT, LeViT, MViTv2, TNT): the footprint rule against dense float64
oracles built here from the models' own softmax outputs (an eager float64 copy, taped), the
libraries' own partition functions and average-pooling footprints (tests/hier_oracle.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import vitexplain as vx
from hier_oracle import DenseCall, assert_matches_oracle, carry, pool_matrix, scatter_windows, taped_attention

timm = pytest.importorskip("timm")
from timm.models.maxxvit import grid_partition, window_partition  # noqa: E402

SIZE = (64, 64)
CLASSES = 5
KINDS = {
    "pit": ("pit_ti_224", dict(img_size=64, depth=(1, 2, 1))),
    "pit_distilled": ("pit_ti_distilled_224", dict(img_size=64, depth=(1, 1, 1))),
    "maxvit": ("maxvit_pico_rw", dict(embed_dim=(16, 32, 32, 32), depths=(1, 2, 1, 1), stem_width=(16, 16))),
    # MaxxViT-V2: ConvNeXt blocks (strided depthwise conv) and grid attention only (no block attention)
    "maxxvitv2": ("maxxvitv2_nano_rw", dict(embed_dim=(16, 32, 32, 32), depths=(1, 2, 1, 1), stem_width=(16, 16))),
    "levit": ("levit_128s", dict(img_size=64, embed_dim=(32, 48, 64), depth=(1, 2, 1), num_heads=(2, 2, 2), key_dim=8)),
    # conv mode: the same blocks on (B, C, H, W) maps (1 x 1 convs, an average pooling of kernel 1 subsamples queries)
    "levit_conv": ("levit_conv_128s", dict(img_size=64, embed_dim=(32, 48, 64), depth=(1, 2, 1), num_heads=(2, 2, 2),
                                           key_dim=8)),
    "mvit": ("mvitv2", dict(depths=(1, 2, 1, 2), embed_dim=16, num_heads=1)),
    "tnt": ("tnt_s_patch16_224", dict(img_size=64, depth=2)),
}


def build(kind: str) -> nn.Module:
    name, kwargs = KINDS[kind]
    torch.manual_seed(0)
    if kind in ("maxvit", "maxxvitv2"):  # a tiny MaxViT: timm's pico config, narrower and shallower
        from timm.models.maxxvit import MaxxVit, model_cfgs
        base = model_cfgs[name]
        cfg = dataclasses.replace(base, **kwargs, transformer_cfg=dataclasses.replace(base.transformer_cfg, dim_head=8))
        model = MaxxVit(cfg, img_size=SIZE, num_classes=CLASSES).eval()
    elif kind == "mvit":
        from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg
        model = MultiScaleVit(MultiScaleVitCfg(**kwargs), img_size=SIZE, num_classes=CLASSES).eval()
    else:
        model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.out_features == CLASSES:
                module.weight.normal_(0, 0.5)
    return model


def _out(grid, k, s, p):
    k, s, p = (v if isinstance(v, (tuple, list)) else (v, v) for v in (k, s, p))
    return tuple((grid[i] + 2 * p[i] - k[i]) // s[i] + 1 for i in range(2))


def _eye(n):
    return torch.eye(n, dtype=torch.float64)


def _windows(a, g, part, grid, size, batch):
    """Scatter (B * nW, H, n, n) window attention onto the grid via timm's own partition."""
    n = grid[0] * grid[1]
    idx = part(torch.arange(n).view(1, *grid, 1), list(size)).reshape(-1, size[0] * size[1])
    a = a.reshape(batch, idx.shape[0], *a.shape[1:])
    g = g.reshape(batch, idx.shape[0], *g.shape[1:])
    return scatter_windows(a, idx, idx, n, n), scatter_windows(g, idx, idx, n, n)


def dense_chain(kind, model, x, target):
    """(items, index of the last stage's first item inside the stage, readout row)."""
    taped = taped_attention(model, x, target)
    if kind == "tnt":
        taped = taped[1::2]  # inner (pixel) attention, then outer, per block
    seen = iter(taped)
    b = x.shape[0]
    items, last_start = [], 0
    if kind.startswith("pit"):
        p = model.cls_token.shape[1]
        conv = model.patch_embed.conv
        grid = _out(SIZE, conv.kernel_size, conv.stride, conv.padding)
        for stage in model.transformers:
            if stage.pool is not None:
                c = stage.pool.conv
                items.append(pool_matrix(grid, c.kernel_size, c.stride, c.padding, prefix=p))
                grid = _out(grid, c.kernel_size, c.stride, c.padding)
            last_start = len(items)
            n = p + grid[0] * grid[1]
            for _ in stage.blocks:
                a, g = next(seen)
                items.append(DenseCall(a, g, _eye(n), _eye(n)))
        u = torch.zeros(b, n, dtype=torch.float64)
        u[:, :p] = 1.0 / p
        return items, last_start, u
    if kind in ("maxvit", "maxxvitv2"):
        grid = SIZE
        for conv in (m for m in model.stem.modules() if isinstance(m, nn.Conv2d)):
            grid = _out(grid, conv.kernel_size, conv.stride, conv.padding)
        first = True
        for stage in model.stages:
            for i, block in enumerate(stage.blocks):
                dw = block.conv.conv_dw if kind == "maxxvitv2" else block.conv.conv2_kxk
                if dw.stride != (1, 1):
                    if not first:
                        items.append(pool_matrix(grid, dw.kernel_size, dw.stride, dw.padding))
                    grid = _out(grid, dw.kernel_size, dw.stride, dw.padding)
                first = False
                if i == 0:
                    last_start = len(items)
                n = grid[0] * grid[1]
                for part in (block.attn_block, block.attn_grid):
                    if part is None:  # (MaxxViT-V2)
                        continue
                    a, g = next(seen)
                    fn = window_partition if part.partition_block else grid_partition
                    a, g = _windows(a, g, fn, grid, part.partition_size, b)
                    items.append(DenseCall(a, g, _eye(n), _eye(n)))
        return items, last_start, torch.full((b, n), 1.0 / n, dtype=torch.float64)
    if kind.startswith("levit"):
        grid = SIZE
        for conv in (m for m in model.stem.modules() if isinstance(m, nn.Conv2d)):
            grid = _out(grid, conv.kernel_size, conv.stride, conv.padding)
        for stage in model.stages:
            n_in = grid[0] * grid[1]
            if not isinstance(stage.downsample, nn.Identity):
                a, g = next(seen)  # queries on every other row and column, keys on the whole grid
                items.append(DenseCall(a, g, _eye(n_in), None))
                grid = ((grid[0] + 1) // 2, (grid[1] + 1) // 2)
            last_start = len(items)
            n = grid[0] * grid[1]
            for _ in stage.blocks:
                a, g = next(seen)
                items.append(DenseCall(a, g, _eye(n), _eye(n)))
        return items, last_start, torch.full((b, n), 1.0 / n, dtype=torch.float64)
    if kind == "mvit":
        conv = model.patch_embed.proj
        grid = _out(SIZE, conv.kernel_size, conv.stride, conv.padding)
        for stage in model.stages:
            for i, block in enumerate(stage.blocks):
                attn = block.attn
                a, g = next(seen)
                pq, pk = attn.pool_q, attn.pool_k
                keys = pool_matrix(grid, pk.kernel_size, pk.stride, pk.padding) if pk is not None else _eye(grid[0] * grid[1])
                new = _out(grid, pq.kernel_size, pq.stride, pq.padding) if pq is not None else grid
                sp = block.shortcut_pool_attn
                skip = pool_matrix(grid, sp.kernel_size, sp.stride, sp.padding) if sp is not None else _eye(grid[0] * grid[1])
                if i == 0 and new == grid:
                    last_start = len(items)
                items.append(DenseCall(a, g, keys, skip))
                if i == 0 and new != grid:
                    last_start = len(items)
                grid = new
        n = grid[0] * grid[1]
        return items, last_start, torch.full((b, n), 1.0 / n, dtype=torch.float64)
    grid = (SIZE[0] // 16, SIZE[1] // 16)  # TNT
    n = 1 + grid[0] * grid[1]
    for _ in model.blocks:
        a, g = next(seen)
        items.append(DenseCall(a, g, _eye(n), _eye(n)))
    u = torch.zeros(b, n, dtype=torch.float64)
    u[:, 0] = 1.0
    return items, 0, u


@pytest.mark.parametrize("kind", list(KINDS))
def test_attention_methods_match_the_dense_float64_oracle(kind):
    model = build(kind)
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    items, last_start, u = dense_chain(kind, model, x, target=1)
    ex = vx.Explainer(model)
    assert ex.family == "hier"
    methods = ("rollout", "generic", "grad_rollout")
    for method, e in zip(methods, ex.explain(x, method=list(methods), target=1)):
        full = carry(items, u, method)
        prefix = full.shape[1] - e.maps.shape[1] * e.maps.shape[2]
        want = full[:, prefix:].reshape(e.maps.shape)
        assert_matches_oracle(e.maps, want, method)
        assert tuple(e.maps.shape[1:]) == e.layout.grid and e.maps.shape[0] == 2
    e = ex.explain(x, method="generic", target=1, stage=-1)
    full = carry(items, u, "generic", start=last_start)
    want = full[:, full.shape[1] - e.maps[0].numel():].reshape(e.maps.shape)
    assert float((e.maps.double() - want).abs().max()) <= 1e-4 * float(want.abs().max())  # (LeViT's is all 0 here)
    for method in ("cdam", "raw"):  # every stage with a grid, B maps on the grid the layout says
        e = ex.explain(x, method=method, target=1)
        assert e.maps.shape[0] == 2 and tuple(e.maps.shape[1:]) == e.layout.grid


def test_a_stage_without_attention_on_its_own_grid_is_refused():
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    torch.manual_seed(0)
    model = MultiScaleVit(MultiScaleVitCfg(depths=(1, 2, 1, 1), embed_dim=16, num_heads=1), img_size=SIZE,
                          num_classes=CLASSES).eval()
    ex = vx.Explainer(model)
    x = torch.randn(1, 3, *SIZE)
    at_2 = ex.explain(x, method="generic", stage=2)
    assert at_2.maps.shape == (1, 4, 4)  # stage 3's call reads stage 2's grid
    with pytest.raises(vx.UnsupportedMethodError, match=r"stage 3 .* no attention call on its own grid.*\[0, 1, 2\]"):
        ex.explain(x, method="generic", stage=3)
    # a negative stage counts from the last stage it can show: -1 is stage 2, on its grid
    last = ex.explain(x, method="generic", stage=-1)
    assert last.layout.grid == (4, 4) and torch.equal(last.maps, at_2.maps)


def test_mvit_cdam_on_a_stage_of_one_pooling_block_is_on_that_stages_grid():
    """MViTv2 with depths (1, 2, 1, 1): stage 2 is a single block that pools stage 1's tokens, so the tokens on
    stage 2's 4 x 4 grid that enter an attention are those of stage 3's pooling block (stage 3 has none).
    S_i = d/de y when that block's input token i is scaled by (1 + e); the last stage asked by number is refused,
    as rollout refuses it, and the default stage (-1: the last stage where CDAM applies) is stage 2."""
    from hier_oracle import token_derivative
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    torch.manual_seed(0)
    model = MultiScaleVit(MultiScaleVitCfg(depths=(1, 2, 1, 1), embed_dim=16, num_heads=1), img_size=SIZE,
                          num_classes=CLASSES).eval().double()
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ex = vx.Explainer(model)
    e = ex.explain(x, method="cdam", target=0, stage=2)
    assert e.maps.shape == (1, 4, 4) and e.layout.grid == (4, 4)
    module = model.get_submodule("stages.3.blocks.0.norm1")
    for t in range(16):
        numeric = token_derivative(module, (t,), lambda: model(x)[0, 0])
        assert abs(float(e.maps[0, t // 4, t % 4]) - numeric) <= 1e-6 + 1e-5 * abs(numeric), (t, numeric)
    for method in ("cdam", "gradcam"):
        with pytest.raises(vx.UnsupportedMethodError, match=r"stage 3 .*no attention call over a token grid.*\[0, 1, 2\]"):
            ex.explain(x, method=method, target=0, stage=3)
        # the default (-1) is the last stage that has one: stage 2, and the layout says its grid
        default, at_2 = ex.explain(x, method=method, target=0), ex.explain(x, method=method, target=0, stage=2)
        assert default.layout.grid == (4, 4) and torch.equal(default.maps, at_2.maps)


def test_levit_cdam_on_a_first_stage_of_one_block_matches_finite_differences():
    """LeViT depth (1, 2, 1): stage 0's one attention block reads the stem's tokens on the 4 x 4 grid (its
    identity downsample passes them on). CDAM at stage 0 is S_i = d/de y when token i entering that block is
    scaled by (1 + e); it used to be refused as if stage 0 had no attention."""
    model = build("levit").double()
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    e = vx.Explainer(model).explain(x, method="cdam", target=0, stage=0)
    assert e.maps.shape == (1, 4, 4) and e.layout.grid == (4, 4)
    module = model.get_submodule("stages.0.blocks.0")
    for t in range(16):
        numeric = _input_derivative(module, t, lambda: model(x)[0, 0])
        assert abs(float(e.maps[0, t // 4, t % 4]) - numeric) <= 1e-6 + 1e-5 * abs(numeric), (t, numeric)


def _input_derivative(module: nn.Module, t: int, score, eps: float = 1e-5) -> float:
    """d score / de when token t of ``module``'s (B, N, C) input is scaled by (1 + e): a central difference."""
    def at(step: float) -> float:
        def scale(mod, args):
            x = args[0].clone()
            x[:, t] *= 1 + step
            return (x, *args[1:])

        handle = module.register_forward_pre_hook(scale)
        try:
            with torch.no_grad():
                return float(score())
        finally:
            handle.remove()

    return (at(eps) - at(-eps)) / (2 * eps)


_POOLED = {
    "samvit": ("samvit_base_patch16", dict(img_size=64, depth=2, embed_dim=32, num_heads=2, global_attn_indexes=(1,),
                                            window_size=3, neck_chans=16)),
    "maxvit": ("maxvit_tiny_tf_224", dict(img_size=64, embed_dim=(32, 32, 32, 32), depths=(1, 1, 1, 1))),
    "hiera": ("hiera_tiny_224", dict(img_size=64, embed_dim=16, num_heads=1, stages=(1, 1, 1, 2))),
}
_READOUT = ("raw", "rollout", "grad_rollout", "generic")


@pytest.mark.parametrize("kind", list(_POOLED))
def test_a_head_pooling_its_last_tokens_other_than_by_their_mean_refuses_the_attention_methods(kind):
    """The attention methods start from the row the head reads: the mean of the last tokens for these models.
    Built with global_pool='max' (or 'avgmax') the head reads something else, and their maps would silently
    explain the mean: they are refused with the reason, while CDAM (the gradient of the model's own output)
    still runs and is the default; global_pool='avg' keeps them."""
    name, kwargs = _POOLED[kind]
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    for pool in ("max", "avgmax"):
        torch.manual_seed(0)
        ex = vx.Explainer(timm.create_model(name, pretrained=False, num_classes=CLASSES, global_pool=pool, **kwargs).eval())
        assert not set(_READOUT) & set(ex.methods()) and "cdam" in ex.methods()
        for method in _READOUT:
            with pytest.raises(vx.UnsupportedMethodError, match=rf"global_pool='{pool}'.*mean of its last tokens"):
                ex.explain(x, method=method, target=1)
        e = ex.explain(x, target=1)
        assert e.method == "cdam" and e.maps.shape == (1, *e.layout.grid)
    ex = vx.Explainer(timm.create_model(name, pretrained=False, num_classes=CLASSES, global_pool="avg", **kwargs).eval())
    assert set(_READOUT) <= set(ex.methods())


def test_tnt_gives_one_map_per_image():
    model = build("tnt")
    x = torch.randn(3, 3, *SIZE)
    for method in vx.Explainer(model).methods():
        if method in ("integrated_gradients", "occlusion", "smoothgrad"):
            continue
        e = vx.Explainer(model).explain(x, method=method)
        expected = (3, *SIZE) if method in ("attnlrp", "cp_lrp") else (3, 4, 4)  # LRP: pixel maps
        assert e.maps.shape == expected, method


@pytest.mark.parametrize("kind", ["levit", "levit_conv", "mvit", "torchvision-maxvit", "maxvit", "tnt"])
def test_a_model_built_for_one_size_gets_its_images_at_that_size_and_other_sizes_are_refused(kind):
    """LeViT's attention biases, MViTv2's relative position tables and torchvision MaxViT's partitions are
    built for one image size (64 px here, not their registered 224): images are preprocessed to it, and a
    tensor of another size is refused with the size to use instead of the model's own shape error. timm
    MaxViT's window and grid partitions are sized from its ``img_size`` (2 x 2 at 64 px): its images are
    preprocessed to that size too (at 224 px its last 7 x 7 grid does not split into them), and a size
    whose grids they do not divide (64 x 96: a 2 x 3 last grid) is refused, not met with timm's assertion. TNT's
    pixel embedding asserts the size it was built for (its images were preprocessed to 224 px and refused)."""
    if kind == "torchvision-maxvit":
        import support_table

        torch.manual_seed(0)
        model = support_table._torchvision_maxvit().eval()
    else:
        model = build(kind)
    ex = vx.Explainer(model)
    assert tuple(ex.adapter.preprocess_kwargs()["input_size"]) == SIZE
    images = [(torch.rand(50, 70, 3, generator=torch.Generator().manual_seed(i)) * 255).to(torch.uint8).numpy()
              for i in range(2)]
    e = ex.explain(images, method="rollout", target=1)
    assert e.maps.shape == (2, *e.layout.grid) and bool(torch.isfinite(e.maps).all())
    assert ex.explain(torch.rand(1, 3, *SIZE), method="rollout", target=1).maps.shape[1:] == e.maps.shape[1:]
    with pytest.raises(vx.InputError, match=rf"does not take a 64x96 input .* expects {SIZE[0]}x{SIZE[1]} images"):
        ex.explain(torch.rand(2, 3, 64, 96), method="rollout", target=1)


def test_default_stage_is_the_last_one_a_token_method_can_show():
    """Hiera with one block per stage and a max-pooling head: its last stage is one block pooling the grid
    before, so no attention runs on its own grid, and with no mean readout the family's default method is
    cdam. ``ex.explain(x)`` with default options gives cdam on stage 2 (the default -1 counts from the last
    stage where CDAM applies), equal to asking stage=2 and equal to central differences of the model's own
    forward with a token entering that attention scaled; stage 3 by number stays refused."""
    from hier_oracle import token_derivative
    from timm.models.hiera import Hiera

    torch.manual_seed(0)
    model = Hiera(img_size=64, embed_dim=16, num_heads=1, num_classes=CLASSES, stages=(1, 1, 1, 1),
                  global_pool="max").eval().double()
    ex = vx.Explainer(model)
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    e = ex.explain(x, target=2)
    assert e.method == "cdam" and e.maps.shape == (1, 4, 4) and e.layout.grid == (4, 4)
    assert torch.equal(e.maps, ex.explain(x, method="cdam", target=2, stage=2).maps)
    with pytest.raises(vx.UnsupportedMethodError, match=r"stage 3 .*no attention call over a token grid.*\[0, 1, 2\]"):
        ex.explain(x, method="cdam", target=2, stage=3)
    with pytest.raises(vx.OptionError, match="stage"):  # three stages where it applies: -4 is none of them
        ex.explain(x, method="cdam", target=2, stage=-4)
    # the tokens entering stage 3's pooling attention (blocks.3.norm1), in Hiera's unrolled order: put on the grid
    # by the model's own unroll of token indices (16 tokens of the 4 x 4 grid of stage 2)
    order = model.unroll(torch.arange(256, dtype=torch.float64).view(1, -1, 1))[0, :, 0].long()
    module = model.get_submodule("blocks.3.norm1")
    for t in range(16):
        cell = int(order[t])  # stage 2 keeps the first 16 of the unrolled order: fine cell -> its 4 x 4 cell
        row, col = (cell // 16) // 4, (cell % 16) // 4
        numeric = token_derivative(module, (t,), lambda: model(x)[0, 2])
        assert abs(float(e.maps[0, row, col]) - numeric) <= 1e-6 + 1e-5 * abs(numeric), (t, numeric)
