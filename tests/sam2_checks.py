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


def dense_calls(taped: list, blocks, batch: int, window_of, pools, partition, unpartition) -> tuple[list, tuple[int, int]]:
    """Dense calls on each stage's row-major grid, forward order, and the last grid.

    Args:
        taped: (A, dy/dA) per block, (B * nW, heads, n_q, n_k), from an eager float64 copy.
        blocks: the model's blocks; ``window_of(block)`` its (wh, ww) window ((0, 0): global); ``pools(block)``
            whether it pools its queries 2 x 2.
        partition: ``(grid, window) -> (nW, wh * ww)`` grid index of each window slot (-1: padding), the
            library's own partition run on token indices; ``unpartition``: ``(coarse, window, nW) -> (nW, wh * ww)``
            coarse-grid index of each pooled query slot (-1: cropped).
    """
    from hier_oracle import DenseCall, pool_matrix, scatter_windows

    grid = GRIDS[0]
    items = []
    eye = lambda n: torch.eye(n, dtype=torch.float64)  # noqa: E731
    taped = iter(taped)
    for block in blocks:
        a, g = next(taped)
        n = grid[0] * grid[1]
        window = window_of(block)
        if pools(block):
            coarse = (grid[0] // 2, grid[1] // 2)
            k_idx = partition(grid, window)
            q_idx = unpartition(coarse, (window[0] // 2, window[1] // 2), k_idx.shape[0])
            skip = pool_matrix(grid, 2, 2, 0)  # the residual's 2 x 2 max pooling, read evenly
        else:
            coarse = grid
            k_idx = partition(grid, window) if any(window) else torch.arange(n)[None]
            q_idx, skip = k_idx, eye(n)
        m = coarse[0] * coarse[1]
        a = a.reshape(batch, k_idx.shape[0], *a.shape[1:])
        g = g.reshape(batch, k_idx.shape[0], *g.shape[1:])
        items.append(DenseCall(scatter_windows(a, q_idx, k_idx, m, n), scatter_windows(g, q_idx, k_idx, m, n), eye(n), skip))
        grid = coarse
    assert next(taped, None) is None  # one attention per block
    return items, grid
