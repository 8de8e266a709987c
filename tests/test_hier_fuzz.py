"""Hierarchical transformers fuzzed where earlier tests did not go (other seeds, non-square inputs, strides and
windows of other shapes), each case against an independent expectation: a dense float64 oracle written here
(tests/hier_oracle.py's helpers; the model's own reordering code run on token indices), finite differences, or a
batch against its images one by one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitexplain as vx
from hier_oracle import assert_matches_oracle, carry, hiera_call, taped_attention, token_derivative

timm = pytest.importorskip("timm")
import support_table as support  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CLASSES = 5


def _reinit(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random-init heads made to tell the classes apart (tiny heads give maps of ~0)."""
    support.reinit_heads(model, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.out_features == CLASSES:
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.5)
    return model.eval()


# -- Hiera with a pooling stride other than 2 x 2 ----------------------------------------------------------------
def _hiera(kind: str, q_stride: tuple[int, int], size: tuple[int, int], mask_unit: tuple[int, int]) -> nn.Module:
    """timm's ``Hiera`` or Hugging Face's ``HieraForImageClassification``: blocks 0 | 1 (pools), 2 | 3 (pools), 4."""
    torch.manual_seed(4)
    if kind == "timm":
        from timm.models.hiera import Hiera

        model = Hiera(img_size=size, embed_dim=16, num_heads=2, num_classes=CLASSES, stages=(1, 2, 2), q_stride=q_stride,
                      mask_unit_size=mask_unit, q_pool=2)
    else:
        transformers = pytest.importorskip("transformers")
        model = transformers.HieraForImageClassification(transformers.HieraConfig(
            image_size=list(size), embed_dim=16, num_heads=[2, 2, 2], depths=[1, 2, 2], num_query_pool=2,
            query_stride=list(q_stride), masked_unit_size=list(mask_unit), masked_unit_attention=[True, True, False],
            mlp_ratio=2.0, num_labels=CLASSES))
    return _reinit(model, seed=4)


def _hiera_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) in order: timm's ``blocks``, or Hugging Face's ``hiera.encoder.stages[*].layers``."""
    if hasattr(model, "blocks"):
        return [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]
    return [(f"hiera.encoder.stages.{s}.layers.{i}", layer) for s, stage in enumerate(model.hiera.encoder.stages)
            for i, layer in enumerate(stage.layers)]


def _rerolled(model: nn.Module, stage: int, n: int) -> torch.Tensor:
    """(H, W): the unrolled position of each cell of ``stage``'s grid, by the model's own reroll (timm's takes
    a block index: stage s's first block is 2 s - 1 here; Hugging Face's a stage index)."""
    idx = torch.arange(n, dtype=torch.float64).view(1, n, 1)
    if hasattr(model, "reroll"):
        out = model.reroll(idx, max(2 * stage - 1, 0))
    else:
        out = model.hiera.encoder.reroll(idx, stage_idx=stage, bool_masked_pos=None)
    return out[0, ..., 0].round().long()


def _hiera_items(model: nn.Module, x: torch.Tensor, target: int) -> list:
    """Dense calls in the unrolled order (token t of a call: window t % nW, slot t // nW; pooled queries and the
    residual the mean over the q chunks), from the eager float64 copy's softmax outputs ((B * heads, nW, n, n)
    from timm, (B, heads, nW, n, n) from Hugging Face)."""
    score = target if hasattr(model, "blocks") else (lambda m, inp: m(pixel_values=inp).logits[:, target])
    taped = iter(taped_attention(model, x, score))
    b, n = x.shape[0], (x.shape[-2] // 4) * (x.shape[-1] // 4)
    items = []
    for _, block in _hiera_layers(model):
        attn = block.attn
        a, g = next(taped)
        stride = int(getattr(attn, "q_stride", getattr(attn, "query_stride", 1)))
        windows = n // (stride * attn.window_size) if attn.use_mask_unit_attn else 1
        a, g = (t.reshape(b, -1, windows, *t.shape[-2:]).transpose(1, 2) for t in (a, g))
        items.append(hiera_call(a, g, n, stride, windows))
        n //= stride
    return items


@pytest.mark.parametrize("kind,q_stride,size,mask_unit", [
    ("timm", (2, 1), (64, 64), (4, 4)), ("timm", (1, 2), (48, 96), (2, 4)), ("hf", (2, 1), (64, 48), (4, 2))],
    ids=["timm-2x1", "timm-1x2", "hf-2x1"])
def test_hiera_pooling_with_a_stride_other_than_2x2_matches_the_oracle_and_finite_differences(kind, q_stride, size,
                                                                                              mask_unit):
    """Hiera's q_stride (2, 1) pools 2 rows into 1 and keeps the columns: stage grids 16 x 16, 8 x 16, 4 x 16 at
    64 px. The adapter took every pooling as 2 x 2: rollout was refused as a capture error ('explain the model at
    the input size it was built for', at that size) and CDAM at stage 1 put 128 tokens on an 8 x 8 grid, two to a
    cell, silently. Oracle: the dense float64 carry in the unrolled order, put on each stage's grid by the model's
    own reroll; CDAM against central differences of the model's forward with one token scaled."""
    model = _hiera(kind, q_stride, size, mask_unit)
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(8))
    ex = vx.Explainer(model)
    items = _hiera_items(model, x, target=1)
    u = torch.full((2, items[-1].probs.shape[2]), 1.0 / items[-1].probs.shape[2], dtype=torch.float64)
    for stage, start in ((0, 0), (1, 2), (2, 4)):  # each stage's first item on its own grid
        cells = _rerolled(model, stage, items[start].keys.shape[0])
        for method in ("rollout", "generic", "grad_rollout"):
            e = ex.explain(x, method=method, target=1, stage=stage)
            want = carry(items, u, method, start=start)[:, cells.flatten()].view(2, *cells.shape)
            assert e.maps.shape == want.shape and e.layout.grid == tuple(cells.shape)
            assert_matches_oracle(e.maps, want, (method, stage))
    one, double = x[:1].double(), model.double()
    logit = (lambda: double(one)[0, 0]) if kind == "timm" else (lambda: double(pixel_values=one).logits[0, 0])
    e = vx.Explainer(double).explain(one, method="cdam", target=0, stage=1)
    cells = _rerolled(double, 1, e.maps[0].numel())
    assert e.maps.shape == (1, *cells.shape)
    site = _hiera_layers(double)[2]  # the tokens entering stage 1's last attention
    norm = site[1].get_submodule("norm1" if kind == "timm" else "layernorm_before")
    for i, j in ((0, 0), (cells.shape[0] - 1, cells.shape[1] - 1), (1, cells.shape[1] // 2)):
        numeric = token_derivative(norm, (int(cells[i, j]),), logit)
        assert abs(float(e.maps[0, i, j]) - numeric) <= 1e-6 + 1e-5 * abs(numeric), (i, j, numeric)


# -- CrossViT averaging its patches: raw on a fusion call -----------------------------------------------------------
def _crossvit(pool: str) -> nn.Module:
    from timm.models.crossvit import CrossVit

    torch.manual_seed(6)
    return _reinit(CrossVit(img_size=48, img_scale=(1.0, 32 / 48), patch_size=(8, 16), embed_dim=(16, 32),
                            depth=((1, 1, 0),), num_heads=(2, 2), mlp_ratio=(2, 2, 1), num_classes=CLASSES,
                            global_pool=pool), seed=6)


@pytest.mark.parametrize("pool", ["avg", "token"])
def test_crossvit_raw_on_a_fusion_call_is_its_class_tokens_attention_whatever_the_head_reads(pool):
    """A fusion call's only query is a branch's class token, attending to itself and the other branch's patches.
    With global_pool='avg' the head reads no class token, so the readout restricted to that query was empty and
    raw returned maps of zeros for both fusion calls, silently. Oracle: the eager float64 copy's softmax of each
    fusion call (calls in order: branch 0's block, branch 1's, fusion 0, fusion 1), mean over heads, the other
    branch's patches on its grid."""
    model = _crossvit(pool)
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(9))
    taped = taped_attention(model, x, 1)
    assert len(taped) == 4
    ex = vx.Explainer(model)
    for layer, other in ((2, (2, 2)), (3, (6, 6))):
        a = taped[layer][0]  # (B, heads, 1, 1 + other patches)
        want = a.double().mean(dim=1)[:, 0, 1:].reshape(2, *other)
        e = ex.explain(x, method="raw", target=1, layer=layer)
        assert e.maps.shape == (2, *other) == (2, *e.layout.grid)
        assert_matches_oracle(e.maps, want, (pool, layer))


# -- SAM's ViT with one head --------------------------------------------------------------------------------------
def _sam_dense(model: nn.Module, x: torch.Tensor, target: int, neck: bool = True) -> list:
    """SAM's calls on the patch grid: each taped softmax (B * nW * heads, n, n) scattered through timm's own
    ``window_partition`` of token indices (padding reads -1), then (``neck``) the neck's 3 x 3 conv as an average
    footprint."""
    from hier_oracle import DenseCall, pool_matrix, scatter_windows
    from timm.models.vision_transformer_sam import window_partition

    b, patch = x.shape[0], model.patch_embed.patch_size
    grid = (x.shape[-2] // patch[0], x.shape[-1] // patch[1])
    n = grid[0] * grid[1]
    eye = torch.eye(n, dtype=torch.float64)
    items = []
    for block, (a, g) in zip(model.blocks, taped_attention(model, x, target)):
        heads = block.attn.num_heads
        if block.window_size:
            idx, _ = window_partition((torch.arange(n) + 1).view(1, *grid, 1).double(), block.window_size)
            idx = idx.reshape(idx.shape[0], -1).round().long() - 1
        else:
            idx = torch.arange(n)[None]
        a, g = (t.reshape(b, idx.shape[0], heads, *t.shape[-2:]) for t in (a, g))
        items.append(DenseCall(scatter_windows(a, idx, idx, n, n), scatter_windows(g, idx, idx, n, n), eye, eye))
    if neck:
        items.append(pool_matrix(grid, 3, 1, 1))  # neck.2: the 3 x 3 conv (padding 1) on the same grid
    return items


def test_sam_vit_with_one_head_matches_the_oracle():
    """SAM folds its heads into SDPA's batch; with num_heads=1 the record has no head dimension at all
    ((B * nW, n, n)), and rollout, generic and raw failed with torch's own shape error. A 48 x 80 input (3 x 5
    patches, windows of 2 padded at the bottom and right), a batch of 3 (also with a target per image, against its
    images one by one), one windowed and one global block."""
    torch.manual_seed(7)
    model = _reinit(timm.create_model("samvit_base_patch16", pretrained=False, num_classes=CLASSES, img_size=(48, 80),
                                      depth=2, embed_dim=16, num_heads=1, global_attn_indexes=(1,), window_size=2,
                                      neck_chans=8), seed=7)
    x = torch.randn(3, 3, 48, 80, generator=torch.Generator().manual_seed(7))
    items = _sam_dense(model, x, target=1)
    ex = vx.Explainer(model)
    u = torch.full((3, 15), 1.0 / 15, dtype=torch.float64)
    for method in ("rollout", "generic", "grad_rollout"):
        e = ex.explain(x, method=method, target=1)
        assert e.maps.shape == (3, 3, 5) == (3, *e.layout.grid)
        assert_matches_oracle(e.maps, carry(items, u, method).view(3, 3, 5), method)
    for layer in (0, 1):
        e = ex.explain(x, method="raw", target=1, layer=layer, head=0)
        assert_matches_oracle(e.maps, items[layer].probs[:, 0].mean(dim=1).view(3, 3, 5), ("raw", layer))
    targets = [0, 3, 1]  # a target per image: the batch's maps are its images' maps one by one
    for method in ("generic", "cdam"):
        together = ex.explain(x, method=method, target=targets).maps
        alone = torch.cat([ex.explain(x[i:i + 1], method=method, target=t).maps for i, t in enumerate(targets)])
        torch.testing.assert_close(together, alone, atol=1e-5 * float(alone.abs().max()), rtol=1e-4)


def test_sam_vit_without_a_conv_neck_is_explained():
    """timm's registered classifier ``samvit_base_patch16_224`` is built with neck_chans=None: its neck is one
    LayerNorm2d, not a Sequential, and every method failed with "'LayerNorm2d' object is not iterable". Its
    config (relative positions, windows and global blocks) made tiny; oracle: the calls alone (a norm mixes no
    tokens), a batch of 3; CDAM against finite differences of the model with one token scaled."""
    torch.manual_seed(8)
    model = _reinit(timm.create_model("samvit_base_patch16_224", pretrained=False, num_classes=CLASSES, img_size=64,
                                      depth=2, embed_dim=32, num_heads=2, global_attn_indexes=(1,), window_size=3),
                    seed=8)
    assert not isinstance(model.neck, nn.Sequential)
    x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(8))
    items = _sam_dense(model, x, target=1, neck=False)
    ex = vx.Explainer(model)
    u = torch.full((3, 16), 1.0 / 16, dtype=torch.float64)
    for method in ("rollout", "generic", "grad_rollout"):
        e = ex.explain(x, method=method, target=1)
        assert e.maps.shape == (3, 4, 4) == (3, *e.layout.grid)
        assert_matches_oracle(e.maps, carry(items, u, method).view(3, 4, 4), method)
    double, one = model.double(), x[:1].double()
    e = vx.Explainer(double).explain(one, method="cdam", target=0)
    for i, j in ((0, 0), (1, 2), (3, 3)):
        numeric = token_derivative(double.get_submodule("blocks.1.norm1"), (i, j), lambda: double(one)[0, 0])
        assert abs(float(e.maps[0, i, j]) - numeric) <= 1e-6 + 1e-5 * abs(numeric), (i, j, numeric)


# -- non-square inputs, padded windows, head fusions, discard and raw heads against one dense oracle ---------------
def _probe(module: nn.Module, grid: tuple[int, int], prefix: int = 0) -> tuple[torch.Tensor, tuple[int, int]]:
    """D (prefix + n_coarse, prefix + n_fine) of a conv or pooling, read from the module itself: a one-channel copy
    with unit weights (no bias) run on one one-hot map per fine cell; each coarse cell spreads evenly over the cells
    that reach it (prefix tokens onto themselves). Also the coarse grid."""
    import copy

    probe = copy.deepcopy(module).double()
    n = grid[0] * grid[1]
    if isinstance(probe, nn.Conv2d):  # one channel in and out, the module's own forward (padding rule included)
        probe.weight = nn.Parameter(torch.ones(1, 1, *probe.kernel_size, dtype=torch.float64))
        probe.bias, probe.groups, probe.in_channels, probe.out_channels = None, 1, 1, 1
    with torch.no_grad():
        out = probe(torch.eye(n, dtype=torch.float64).view(n, 1, *grid))[:, 0]
    reach = (out.flatten(1).T > 0).double()
    d = torch.zeros(prefix + reach.shape[0], prefix + n, dtype=torch.float64)
    d[:prefix, :prefix] = torch.eye(prefix, dtype=torch.float64)
    d[prefix:, prefix:] = reach / reach.sum(dim=1, keepdim=True)
    return d, tuple(out.shape[-2:])


def _call(a: torch.Tensor, g: torch.Tensor, keys: torch.Tensor, skip: torch.Tensor, idx=None, b: int = 0):
    """A DenseCall of (B, H, n, m) probabilities, or of per-window ones (B * nW, H, w, w) scattered by ``idx``
    (nW, w) grid indices (-1: padding); ``pairs``: the (query, key) pairs the call has (padding left out)."""
    from hier_oracle import DenseCall, scatter_windows

    if idx is not None:
        n = keys.shape[0]
        a, g = (scatter_windows(t.reshape(b, idx.shape[0], *t.shape[-3:]), idx, idx, n, n) for t in (a, g))
        ones = torch.ones(1, idx.shape[0], 1, idx.shape[1], idx.shape[1])
        pairs = scatter_windows(ones, idx, idx, n, n)[0, 0] > 0
    else:
        pairs = torch.ones(a.shape[-2:], dtype=torch.bool)
    call = DenseCall(a.double(), g.double(), keys, skip)
    call.pairs = pairs
    return call


def _pvt(x: torch.Tensor, target: int):
    torch.manual_seed(11)
    model = _reinit(timm.create_model("pvt_v2_b0", pretrained=False, num_classes=CLASSES, depths=(1, 2, 1, 1),
                                      embed_dims=(16, 32, 48, 64), num_heads=(2, 2, 4, 4)), seed=11)
    taped = iter(taped_attention(model, x, target))
    items, starts = [], []
    grid = tuple(model.patch_embed.proj(x).shape[-2:])
    for s, stage in enumerate(model.stages):
        if s > 0:
            d, grid = _probe(stage.downsample.proj, grid)
            items.append(d)
        starts.append(len(items))
        eye = torch.eye(grid[0] * grid[1], dtype=torch.float64)
        for block in stage.blocks:
            a, g = next(taped)
            keys = _probe(block.attn.sr, grid)[0] if block.attn.sr is not None else eye
            items.append(_call(a, g, keys, eye))
    return model, items, starts, 0


def _svt(x: torch.Tensor, target: int):
    import torch.nn.functional as F

    torch.manual_seed(12)
    model = _reinit(timm.create_model("twins_svt_small", pretrained=False, num_classes=CLASSES, depths=(1, 2, 1, 1),
                                      embed_dims=(16, 32, 48, 64), num_heads=(2, 2, 2, 4), wss=[3, 3, 3, 3],
                                      img_size=64), seed=12)
    taped = iter(taped_attention(model, x, target))
    items, starts, grid = [], [], tuple(x.shape[-2:])
    for s, (embed, blocks) in enumerate(zip(model.patch_embeds, model.blocks)):
        if s == 0:
            grid = tuple(embed.proj(x).shape[-2:])
        else:
            d, grid = _probe(embed.proj, grid)
            items.append(d)
        starts.append(len(items))
        n = grid[0] * grid[1]
        eye = torch.eye(n, dtype=torch.float64)
        for block in blocks:
            a, g = next(taped)
            if type(block.attn).__name__ == "LocallyGroupedAttn":  # the model's own padding and reshape, on indices
                ws = block.attn.ws
                hp, wp = -(-grid[0] // ws) * ws, -(-grid[1] // ws) * ws
                idx = F.pad(torch.arange(n).view(1, *grid, 1) + 1, (0, 0, 0, wp - grid[1], 0, hp - grid[0])) - 1
                idx = idx.reshape(1, hp // ws, ws, wp // ws, ws, 1).transpose(2, 3).reshape(-1, ws * ws)
                items.append(_call(a, g, eye, eye, idx, x.shape[0]))
            else:
                keys = _probe(block.attn.sr, grid)[0] if block.attn.sr is not None else eye
                items.append(_call(a, g, keys, eye))
    return model, items, starts, 0


def _maxvit_tf(x: torch.Tensor, target: int):
    import dataclasses

    from timm.models.maxxvit import MaxxVit, grid_partition, model_cfgs, window_partition

    base = model_cfgs["maxvit_tiny_tf"]  # TF 'same' padding: a stride-2 conv pads 0 before, 1 after on even grids
    cfg = dataclasses.replace(base, embed_dim=(16, 32, 32, 32), depths=(1, 1, 1, 1), stem_width=(16, 16),
                              transformer_cfg=dataclasses.replace(base.transformer_cfg, dim_head=8))
    torch.manual_seed(13)
    model = _reinit(MaxxVit(cfg, img_size=tuple(x.shape[-2:]), num_classes=CLASSES), seed=13)
    taped = iter(taped_attention(model, x, target))
    grid = tuple(model.stem(x).shape[-2:])
    items, starts = [], []
    for s, stage in enumerate(model.stages):
        for i, block in enumerate(stage.blocks):
            if block.conv.conv2_kxk.stride != (1, 1):
                d, grid = _probe(block.conv.conv2_kxk, grid)
                if s > 0:
                    items.append(d)
            if i == 0:
                starts.append(len(items))
            n = grid[0] * grid[1]
            eye = torch.eye(n, dtype=torch.float64)
            for part in (block.attn_block, block.attn_grid):
                a, g = next(taped)
                size = list(part.partition_size)
                split = window_partition if part.partition_block else grid_partition
                idx = split(torch.arange(n).view(1, *grid, 1), size).reshape(-1, size[0] * size[1])
                items.append(_call(a, g, eye, eye, idx, x.shape[0]))
    return model, items, starts, 0


def _mvit_cls(x: torch.Tensor, target: int):
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    torch.manual_seed(14)
    model = MultiScaleVit(MultiScaleVitCfg(depths=(1, 1, 1, 2), embed_dim=16, num_heads=2, use_cls_token=True,
                                           use_abs_pos=True, rel_pos_type="none"),
                          img_size=tuple(x.shape[-2:]), num_classes=CLASSES, global_pool="token")
    with torch.no_grad():  # timm's init makes its attention near uniform: unit-gain weights
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / p[0].numel() ** 0.5, generator=torch.Generator().manual_seed(14))
    model = _reinit(model, seed=14)
    taped = iter(taped_attention(model, x, target))
    grid = tuple(model.patch_embed.proj(x).shape[-2:])
    items, starts = [], []
    for stage in model.stages:
        for i, block in enumerate(stage.blocks):
            a, g = next(taped)
            attn, eye = block.attn, torch.eye(1 + grid[0] * grid[1], dtype=torch.float64)
            keys = _probe(attn.pool_v, grid, prefix=1)[0] if attn.pool_v is not None else eye
            skip = _probe(block.shortcut_pool_attn, grid, 1)[0] if block.shortcut_pool_attn is not None else eye
            new = _probe(attn.pool_q, grid)[1] if attn.pool_q is not None else grid
            items.append(_call(a, g, keys, skip))
            if i == 0:
                starts.append(len(items) - (new == grid))  # a pooling first block reads the grid before
            grid = new
    return model, items, starts, 1


_FAMILIES = {"pvt": (_pvt, (50, 77)), "svt": (_svt, (60, 92)), "maxvit_tf": (_maxvit_tf, (64, 96)),
             "mvit_cls": (_mvit_cls, (48, 80))}


@pytest.mark.parametrize("kind", list(_FAMILIES))
def test_non_square_inputs_fusions_discard_and_raw_heads_match_the_dense_oracle(kind):
    """Non-square inputs whose sides the patch, the windows or the strides do not divide (PVTv2 50 x 77: 13 x 20
    tokens; Twins SVT 60 x 92 with 3 x 3 windows padded; MaxViT with TF 'same' convs at 64 x 96; MViTv2 with a
    class token read by the head at 48 x 80), batches of 2. Oracle: each call's eager float64 softmax placed on
    its grid by the models' own partition code, footprints read from the models' convs and poolings by probing
    them with one-hot maps. Checked: rollout with head_fusion mean / max / min and discard_ratio (per call and
    image, among the call's real pairs), grad_rollout (also with discard), generic, at stage 0 and at the last
    stage; raw of the last call for its first and last head; the grid and cell size ``e.layout`` says."""
    from hier_oracle import _rownorm  # noqa: F401  (the oracle's row normalisation: rows of nothing stay 0)

    build, size = _FAMILIES[kind]
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(len(kind)))
    model, items, starts, prefix = build(x, 1)
    ex = vx.Explainer(model)
    n = items[-1].probs.shape[2]
    u = torch.zeros(2, n, dtype=torch.float64)
    u[:, 0 if prefix else slice(None)] = 1.0 if prefix else 1.0 / n
    grids = [s.grid for s in ex.adapter.stage_sets(size)]
    cases = [("rollout", {}), ("rollout", {"head_fusion": "max"}), ("rollout", {"head_fusion": "min", "discard_ratio": 0.3}),
             ("grad_rollout", {"discard_ratio": 0.2}), ("generic", {}), ("rollout", {"stage": -1}),
             ("generic", {"stage": -1}), ("grad_rollout", {"stage": -1})]
    for method, options in cases:
        e = ex.explain(x, method=method, target=1, **options)
        stage = options.get("stage", 0) % len(grids)
        want = _dense_carry(items, u, method, starts[stage], options.get("head_fusion", "mean"),
                            options.get("discard_ratio", 0.0))[:, prefix:].reshape(2, *grids[stage])
        assert e.maps.shape == want.shape and e.layout.grid == grids[stage], (method, options)
        assert e.layout.patch_size == tuple(round(s / g) for s, g in zip(size, grids[stage]))
        if method == "grad_rollout" and not bool(want.any()):  # every clamp(mean_h(A dy/dA), 0) of the stage is 0
            assert not bool(e.maps.any()), (method, options)   # (MaxViT's last 2 x 3 grid here): so is the map
            continue
        assert_matches_oracle(e.maps, want, (method, options))
    last = items[-1]
    for head in (0, -1):
        e = ex.explain(x, method="raw", target=1, head=head)
        want = (torch.einsum("bn,bnk->bk", u, last.probs[:, head]) @ last.keys)[:, prefix:]
        assert_matches_oracle(e.maps, want.reshape(e.maps.shape), ("raw", head))


def _dense_carry(items: list, u: torch.Tensor, mode: str, start: int, fusion: str, ratio: float) -> torch.Tensor:
    """hier_oracle.carry with rollout's head fusion and discard: per call and image, the ``ratio`` smallest of the
    fused (or gradient-weighted) entries among the call's real pairs set to 0 before the keys' footprint."""
    from hier_oracle import DenseCall

    fused = []
    for item in items:
        if not isinstance(item, DenseCall):
            fused.append(item)
            continue
        if mode == "rollout":
            p = {"mean": item.probs.mean(dim=1), "max": item.probs.amax(dim=1), "min": item.probs.amin(dim=1)}[fusion]
        else:
            p = item.probs * item.grads
            p = p.mean(dim=1).clamp(min=0) if mode == "grad_rollout" else p.clamp(min=0).mean(dim=1)
        count = int(int(item.pairs.sum()) * ratio)
        if count:
            flat = p.flatten(1).clone()
            smallest = flat.masked_fill(~item.pairs.flatten()[None], float("inf")).argsort(dim=1)[:, :count]
            p = flat.scatter(1, smallest, 0.0).view_as(p)
        # one "head" holding the fused matrix; for generic / grad_rollout it is carried as probs * grads = p
        fused.append(DenseCall(p[:, None], torch.ones_like(p[:, None]), item.keys, item.skip))
    return carry(fused, u, "rollout" if mode == "rollout" else mode, start=start)
