"""The checks both implementations of SAM 2's Hiera pass (timm ``HieraDet``: tests/test_hier_sam2_timm.py;
Hugging Face ``Sam2HieraDetModel``: tests/test_hier_hf_more.py), on their tiny 64 px builds with the same
layout: grids 16 x 16, 8 x 8 and 4 x 4; blocks 1 and 3 pool their queries onto the next grid."""

from __future__ import annotations

import torch

import vitexplain as vx
from hier_oracle import assert_matches_oracle, carry

GRIDS = [(16, 16), (8, 8), (4, 4)]


def check_dense_oracle(ex: vx.Explainer, x: torch.Tensor, items: list, grid: tuple[int, int], target) -> None:
    """rollout, generic and grad_rollout on the finest grid, and generic on stages 1 and 2, equal the dense
    float64 oracle ``items`` (forward order) carried back from the mean of the last grid's tokens."""
    n = grid[0] * grid[1]
    u = torch.full((x.shape[0], n), 1.0 / n, dtype=torch.float64)
    methods = ["rollout", "generic", "grad_rollout"]
    for method, e in zip(methods, ex.explain(x, method=methods, target=target)):
        want = carry(items, u, method).view(e.maps.shape)
        assert e.maps.shape == (x.shape[0], *GRIDS[0]) == (x.shape[0], *e.layout.grid), method
        assert e.layout.patch_size == (4, 4)
        assert_matches_oracle(e.maps, want, method)
    for stage, start in ((1, 1), (2, 3)):  # items[1] / items[3] pool onto the stage's grid
        e = ex.explain(x, method="generic", target=target, stage=stage)
        want = carry(items, u, "generic", start=start + 1)
        assert e.maps.shape == (x.shape[0], *GRIDS[stage])
        assert_matches_oracle(e.maps, want.view(e.maps.shape), ("generic", stage))


def check_batch_equals_one_by_one(ex: vx.Explainer, x: torch.Tensor, target) -> None:
    """A batch's maps equal its images' maps one by one, for the attention and token methods at several stages."""
    b = x.shape[0]
    for method, options in (("rollout", {}), ("generic", {"stage": 1}), ("cdam", {}), ("cdam", {"stage": 0}),
                            ("raw", {"layer": 1})):
        together = ex.explain(x, method=method, target=target, **options).maps
        alone = torch.cat([ex.explain(x[i:i + 1], method=method, target=target, **options).maps for i in range(b)])
        assert together.shape[0] == b and tuple(together.shape[1:]) in GRIDS
        torch.testing.assert_close(together, alone, atol=1e-5 * float(alone.abs().max()) + 1e-9, rtol=1e-4)
