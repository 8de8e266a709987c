"""Hiera and torchvision MaxViT: the footprint rule against dense float64 oracles built here.

Hiera's oracle works in the model's *unrolled* token order throughout (the adapter converts to
row-major grids instead): per call, token t of the unrolled sequence is slot t // nW of window
t % nW (MaskUnitAttention's reshape), a pooled query / residual t' is the mean-footprint of
positions t' + c N / q_stride (Hiera's max over chunks), and only the final stage-0 vector is put
on the grid, through the model's own ``unroll`` run on token indices. torchvision MaxViT's
windows come from explicit index formulas (window / grid partition with its axis swap).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitexplain as vx
from hier_oracle import DenseCall, assert_matches_oracle, carry, hiera_call, pool_matrix, scatter_windows, taped_attention

timm = pytest.importorskip("timm")
import support_table as support  # noqa: E402

SIZE = (64, 64)
CLASSES = 5


def _reinit(model: nn.Module) -> nn.Module:
    support.reinit_heads(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.out_features == CLASSES:
                module.weight.normal_(0, 0.5)
    return model.eval()


def hiera(mask_unit_attn: tuple[bool, ...] = (True, True, False, False)) -> nn.Module:
    from timm.models.hiera import Hiera

    torch.manual_seed(0)
    return _reinit(Hiera(img_size=64, embed_dim=16, num_heads=1, num_classes=CLASSES, stages=(1, 2, 2, 1),
                         mask_unit_size=(4, 4), q_pool=2, mask_unit_attn=mask_unit_attn))


def tv_maxvit() -> nn.Module:
    torch.manual_seed(0)
    return _reinit(support._torchvision_maxvit())


def _eye(n):
    return torch.eye(n, dtype=torch.float64)


def hiera_chain(model, x, target):
    taped = iter(taped_attention(model, x, target))
    b = x.shape[0]
    grid = tuple(model.unroll.size)
    n = grid[0] * grid[1]
    items = []
    for block in model.blocks:
        attn = block.attn
        a, g = next(taped)
        q = attn.q_stride
        n_out = n // q
        windows = n // (q * attn.window_size) if attn.use_mask_unit_attn else 1
        if attn.use_mask_unit_attn:  # (B, heads, nW, n_q, n_k) as the model made it
            a = a.reshape(b, attn.heads, windows, *a.shape[-2:]).transpose(1, 2)
            g = g.reshape(b, attn.heads, windows, *g.shape[-2:]).transpose(1, 2)
        else:
            a, g = a[:, None], g[:, None]
        items.append(hiera_call(a, g, n, q, windows))
        n = n_out
    u = torch.full((b, n), 1.0 / n, dtype=torch.float64)
    order = model.unroll(torch.arange(grid[0] * grid[1], dtype=torch.float64).view(1, -1, 1))[0, :, 0].long()
    return items, u, order, grid


# timm's default (mask units in the first two stages), and global attention in every block, whose
# pooling blocks attend from each new token to all the previous stage's tokens (zoo shapes-hier)
@pytest.mark.parametrize("mask_unit_attn", [(True, True, False, False), (False, False, False, False)],
                         ids=["mask-units", "global"])
def test_hiera_matches_the_dense_float64_oracle(mask_unit_attn):
    model = hiera(mask_unit_attn)
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    items, u, order, grid = hiera_chain(model, x, target=1)
    ex = vx.Explainer(model)
    assert ex.family == "hier"
    methods = ["rollout", "generic", "grad_rollout"]
    for method, e in zip(methods, ex.explain(x, method=methods, target=1)):
        unrolled = carry(items, u, method)
        want = torch.zeros_like(unrolled)
        want[:, order] = unrolled  # unrolled position t holds grid token order[t]
        want = want.view(2, *grid)
        assert e.maps.shape == (2, *grid) == (2, *e.layout.grid)
        assert_matches_oracle(e.maps, want, method)
    for stage, side in ((0, 16), (1, 8), (-1, 4)):
        e = ex.explain(x, method="cdam", stage=stage, target=1)
        assert e.maps.shape == (2, side, side) and e.layout.grid == (side, side)


def tv_chain(model, x, target):
    taped = iter(taped_attention(model, x, target))
    b = x.shape[0]
    grid = (SIZE[0] // 2, SIZE[1] // 2)  # the stem's stride-2 conv
    items = []
    first = True
    for block in model.blocks:
        for layer in block.layers:
            conv = layer.layers.MBconv.layers.conv_b[0]
            if conv.stride != (1, 1):
                if not first:
                    items.append(pool_matrix(grid, conv.kernel_size, conv.stride, conv.padding))
                grid = ((grid[0] - 1) // 2 + 1, (grid[1] - 1) // 2 + 1)
            first = False
            h, w = grid
            n = h * w
            for part in (layer.layers.window_attention, layer.layers.grid_attention):
                a, g = next(taped)
                rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
                if part.partition_type == "window":
                    p = part.p
                    window, slot = (rows // p) * (w // p) + cols // p, (rows % p) * p + cols % p
                else:  # the window partition with P = H / g, then the axis swap
                    big = part.p
                    window, slot = (rows % big) * big + cols % big, (rows // big) * (w // big) + cols // big
                count, size = int(window.max()) + 1, int(slot.max()) + 1
                idx = torch.full((count, size), -1, dtype=torch.long)
                idx[window.flatten(), slot.flatten()] = torch.arange(n)
                a = a.reshape(b, count, *a.shape[-3:])  # the model's (B, G, heads, n, n)
                g = g.reshape(b, count, *g.shape[-3:])
                items.append(DenseCall(scatter_windows(a, idx, idx, n, n), scatter_windows(g, idx, idx, n, n),
                                       _eye(n), _eye(n)))
    return items, torch.full((b, n), 1.0 / n, dtype=torch.float64), grid


def test_torchvision_maxvit_matches_the_dense_float64_oracle():
    model = tv_maxvit()
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    items, u, last = tv_chain(model, x, target=1)
    ex = vx.Explainer(model)
    assert ex.family == "hier"
    methods = ["rollout", "generic", "grad_rollout"]
    for method, e in zip(methods, ex.explain(x, method=methods, target=1)):
        want = carry(items, u, method).view(e.maps.shape)
        assert tuple(e.maps.shape[1:]) == e.layout.grid
        assert_matches_oracle(e.maps, want, method)
    e = ex.explain(x, method="cdam", target=1)
    assert e.maps.shape == (2, *last)


def crossvit(fusion: int = 0) -> nn.Module:
    """Fusion depth 0 is timm's single cross-attention block per branch (every registered CrossViT); a depth
    of 2 chains two, the second attending from the class token to itself alone (the first outputs only it)."""
    from timm.models.crossvit import CrossVit

    torch.manual_seed(0)
    return _reinit(CrossVit(img_size=48, img_scale=(1.0, 32 / 48), patch_size=(8, 16), embed_dim=(16, 32),
                            depth=((1, 2, fusion), (1, 1, fusion)), num_heads=(2, 2), mlp_ratio=(2, 2, 1),
                            num_classes=CLASSES))


def crossvit_chain(model, x, target):
    """Dense calls on [cls_0, patches_0 (6x6), cls_1, patches_1 (2x2)] in the model's call order."""
    taped = iter(taped_attention(model, x, target))
    b = x.shape[0]
    sizes = [1 + 36, 1 + 4]
    n, off = sum(sizes), [0, sizes[0]]
    items = []
    for block in model.blocks:
        for br, branch in enumerate(block.blocks):
            for _ in branch:
                a, g = next(taped)
                da = torch.zeros(b, a.shape[1], n, n, dtype=torch.float64)
                dg = torch.zeros_like(da)
                part = slice(off[br], off[br] + sizes[br])
                da[:, :, part, part], dg[:, :, part, part] = a, g
                items.append(DenseCall(da, dg, _eye(n), _eye(n)))
        for br in range(2):
            fusion = block.fusion[br]
            for j in range(len(fusion) if isinstance(fusion, nn.Sequential) else 1):
                # (B, H, 1, 1 + other patches): own (projected) class token, then the other's patches; a
                # chained block after the first gets the class token alone: (B, H, 1, 1)
                a, g = next(taped)
                other = 1 - br
                cols = [off[br]] + (list(range(off[other] + 1, off[other] + sizes[other])) if j == 0 else [])
                da = torch.zeros(b, a.shape[1], n, n, dtype=torch.float64)
                dg = torch.zeros_like(da)
                da[:, :, off[br], cols], dg[:, :, off[br], cols] = a[:, :, 0], g[:, :, 0]
                items.append(DenseCall(da, dg, _eye(n), _eye(n)))
    u = torch.zeros(b, n, dtype=torch.float64)
    u[:, off[0]] = u[:, off[1]] = 0.5  # the head averages both class tokens' logits
    return items, u, off, sizes


@pytest.mark.parametrize("fusion", [0, 2])
def test_crossvit_branch_maps_match_the_joint_dense_oracle_and_say_how_they_combine(fusion):
    model = crossvit(fusion)
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    items, u, off, sizes = crossvit_chain(model, x, target=1)
    ex = vx.Explainer(model)
    assert ex.family == "hier"
    for method in ("rollout", "generic", "grad_rollout"):
        full = carry(items, u, method)
        for branch, side in ((0, 6), (1, 2)):
            e = ex.explain(x, method=method, target=1, stage=branch)
            want = full[:, off[branch] + 1: off[branch] + sizes[branch]].reshape(2, side, side)
            assert e.maps.shape == (2, side, side) and e.layout.grid == (side, side)
            assert_matches_oracle(e.maps, want, (method, branch))
        combined = e.extras["combined"]
        assert combined.shape == (2, 6, 6) and "resized bilinearly" in e.extras["combination"]
        torch.testing.assert_close(
            combined, e.extras["branches"]["branch 0 (6x6)"] + torch.nn.functional.interpolate(
                e.extras["branches"]["branch 1 (2x2)"][:, None], size=(6, 6), mode="bilinear")[:, 0] * (4 / 36))
    for branch, side in ((0, 6), (1, 2)):
        assert ex.explain(x, method="cdam", target=1, stage=branch).maps.shape == (2, side, side)


def test_a_crossvit_branch_that_sees_a_centre_crop_is_refused_not_drawn_over_the_image():
    """timm's crop_scale=True feeds the smaller branch a centre crop of the input: its map (attention methods and the
    token methods) would cover the crop, not the image, so it is refused naming the branch that sees the whole image,
    whose map runs and is the only one among the extras' branch maps (no combination with a cropped branch)."""
    model = crossvit()
    model.crop_scale = True  # (branch 1: 32 px of the 48 px input)
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    ex = vx.Explainer(model)
    for method in ("rollout", "generic", "cdam"):
        with pytest.raises(vx.UnsupportedMethodError, match=r"branch 1 .* sees a 32x32 centre crop .* stage=0"):
            ex.explain(x, method=method, target=1, stage=1)
    e = ex.explain(x, method="rollout", target=1, stage=0)
    assert e.maps.shape == (2, 6, 6) and list(e.extras["branches"]) == ["branch 0 (6x6)"]
    assert "combined" not in e.extras
