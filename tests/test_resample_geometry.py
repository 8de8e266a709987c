"""A call's cached geometry (slots on a device, padding, whole sets, the inverse of slots that hold each token once):
the one-gather scatter against a loop, and the cache per chain (input size) never reused for another size."""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
from vitexplain.methods.resample import _inverse

timm = pytest.importorskip("timm")


def _scatter_loop(v: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    """(B, G, n_slots) -> (B, n): each slot's value added onto its token, one by one."""
    out = torch.zeros(v.shape[0], n, dtype=v.dtype)
    for g in range(slots.shape[0]):
        for s in range(slots.shape[1]):
            if slots[g, s] >= 0:
                out[:, slots[g, s]] += v[:, g, s]
    return out


def test_the_inverse_of_slots_holding_each_token_once_scatters_as_a_loop():
    slots = torch.tensor([[4, 0, 2], [1, 5, 3]])  # two windows, each of the 6 tokens once
    inverse = _inverse(slots, 6)
    v = torch.randn(3, 2, 3)
    assert torch.equal(v.reshape(3, -1).index_select(1, inverse), _scatter_loop(v, slots, 6))


@pytest.mark.parametrize("slots,n", [([[0, 1, -1], [2, 3, -1]], 4),   # padding
                                     ([[0, 1], [1, 2]], 3),             # a token in two slots
                                     ([[0, 2]], 3),                     # a token in none
                                     ([[0, 1], [2, 3]], 3)])            # a slot beyond the set
def test_slots_that_are_not_a_permutation_of_the_set_have_no_inverse(slots, n):
    assert _inverse(torch.tensor(slots), n) is None


def test_one_explainer_at_several_input_sizes_gives_each_size_its_own_geometry():
    """SAM's ViT takes any multiple of its 16 px patch: 3 x 3 windows over a 6 x 6 grid (96 px: 4 windows, each token
    once), a 4 x 4 grid (64 px: padded windows) and a 3 x 3 one (48 px: one window, in order). One explainer going
    back and forth must give what a fresh one gives at each size (a geometry cached for one size and reused at
    another would gather the wrong tokens or fail)."""
    torch.manual_seed(0)
    model = timm.create_model("samvit_base_patch16", pretrained=False, num_classes=5, img_size=64, depth=3,
                              embed_dim=32, num_heads=2, global_attn_indexes=(1,), window_size=3, neck_chans=16).eval()
    ex = vx.Explainer(model)
    for size in (96, 64, 96, 48, 64):
        x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size))
        for method in ("rollout", "generic", "raw"):
            got = ex.explain(x, method=method, target=1).maps
            fresh = vx.Explainer(model).explain(x, method=method, target=1).maps
            assert got.shape == (2, size // 16, size // 16)
            assert torch.equal(got, fresh), (size, method)
