"""Variants of the hierarchical families that the support table's one build per family does not cover (other
heads, sizes, stems, position embeddings, padding), each at a promise a user relies on: a batch equals its images
one by one (and a forward of one input gives what a forward of several does), maps on the grid the layout says and
equal to the families' dense float64 oracles (tests/hier_oracle.py, and the chains of tests/test_hier.py,
tests/test_hier_more.py and tests/test_hier_pooling.py)."""

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


# -- variants against the families' dense float64 oracles -----------------------------------------------------------
def _mvit_chain(model, x, target):
    """MViTv2's dense chain with its class token (tests/test_hier_pooling.py's, which has none, with the class token
    kept by every pooling of keys, values and the residual, as timm's ``MultiScaleAttention`` keeps it)."""
    from hier_oracle import DenseCall, pool_matrix, taped_attention
    from test_hier_pooling import _out

    taped = iter(taped_attention(model, x, target))
    prefix = 1 if model.cls_token is not None else 0
    conv = model.patch_embed.proj
    grid = _out(tuple(x.shape[-2:]), conv.kernel_size, conv.stride, conv.padding)
    items = []
    for stage in model.stages:
        for block in stage.blocks:
            attn, (a, g) = block.attn, next(taped)
            eye = torch.eye(prefix + grid[0] * grid[1], dtype=torch.float64)
            pk, pq, sp = attn.pool_k, attn.pool_q, block.shortcut_pool_attn
            keys = pool_matrix(grid, pk.kernel_size, pk.stride, pk.padding, prefix=prefix) if pk is not None else eye
            skip = pool_matrix(grid, sp.kernel_size, sp.stride, sp.padding, prefix=prefix) if sp is not None else eye
            items.append(DenseCall(a, g, keys, skip))
            grid = _out(grid, pq.kernel_size, pq.stride, pq.padding) if pq is not None else grid
    n = prefix + grid[0] * grid[1]
    u = torch.zeros(x.shape[0], n, dtype=torch.float64)
    if model.global_pool == "token":
        u[:, 0] = 1.0
    else:
        u[:, prefix:] = 1.0 / (n - prefix)
    return items, u


@pytest.mark.parametrize("pool", ["avg", "token"])
def test_mvit_with_a_class_token_matches_the_dense_float64_oracle(pool):
    """``mvitv2_*_cls``: a class token that every pooling keeps, read by the head (``token``) or left out of its mean."""
    from hier_oracle import assert_matches_oracle, carry
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    torch.manual_seed(0)
    model = MultiScaleVit(MultiScaleVitCfg(depths=(1, 2), embed_dim=16, num_heads=1, use_cls_token=True), img_size=64,
                          num_classes=5, global_pool=pool).eval()
    with torch.no_grad():
        model.head.fc.weight.normal_(0, 0.5)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    items, u = _mvit_chain(model, x, 1)
    ex = vx.Explainer(model)
    for method in ("rollout", "generic", "grad_rollout"):
        e = ex.explain(x, method=method, target=1)
        full = carry(items, u, method)
        assert e.maps.shape == (2, 16, 16) == (2, *e.layout.grid)
        assert_matches_oracle(e.maps, full[:, 1:].reshape(e.maps.shape), (pool, method))


@pytest.mark.parametrize("name,size", [("hiera_small_abswin_256", (64, 64)),  # absolute window position embedding
                                       ("hiera_tiny_224", (64, 96))],  # a non-square grid of mask units
                         ids=["abswin", "64x96"])
def test_hiera_variants_match_the_dense_float64_oracle(name, size):
    from hier_oracle import assert_matches_oracle, carry
    from test_hier_more import _reinit, hiera_chain

    torch.manual_seed(0)
    model = _reinit(timm.create_model(name, img_size=size, embed_dim=16, num_heads=1, stages=(1, 2, 2, 1),
                                      mask_unit_size=(4, 4), q_pool=2, num_classes=5))
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    items, u, order, grid = hiera_chain(model, x, target=1)
    ex = vx.Explainer(model)
    for method in ("rollout", "generic", "grad_rollout"):
        e = ex.explain(x, method=method, target=1)
        unrolled = carry(items, u, method)
        want = torch.zeros_like(unrolled)
        want[:, order] = unrolled
        assert e.maps.shape == (2, *grid) == (2, *e.layout.grid)
        assert_matches_oracle(e.maps, want.view(2, *grid), method)


def test_twins_svt_whose_windows_pad_its_later_grids_matches_the_dense_float64_oracle(monkeypatch):
    """Windows of 4 on grids 24, 12, 6 and 3 at 96 px: the last two stages' windows are zero-padded."""
    import test_hier as th
    from hier_oracle import assert_matches_oracle, carry

    kwargs = dict(depths=(1, 1, 2, 1), embed_dims=(16, 32, 48, 64), num_heads=(1, 2, 2, 4), wss=[4, 4, 4, 4], img_size=96)
    monkeypatch.setattr(th, "SIZE", (96, 96))
    monkeypatch.setitem(th.KINDS, "svt", ("twins_svt_small", kwargs))
    model = th.build("svt")
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(1))
    items, _ = th.dense_chain("svt", model, x, 1)
    n = th._last_n(items)
    u = torch.full((2, n), 1.0 / n, dtype=torch.float64)
    ex = vx.Explainer(model)
    for method in ("rollout", "generic", "grad_rollout"):
        e = ex.explain(x, method=method, target=1)
        assert e.maps.shape == (2, 24, 24) == (2, *e.layout.grid)
        assert_matches_oracle(e.maps, carry(items, u, method).view(e.maps.shape), method)
