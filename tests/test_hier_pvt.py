"""Hugging Face PVT v1 (``PvtForImageClassification``, ``PvtModel``): the hierarchical family.

Oracles, built here without vitexplain's resampling code: the attention probabilities and dy/dA of an eager
float64 copy (tests/hier_oracle.py: every softmax the model computes), the patch embeddings' and the keys'
spatial reductions (strided convs, kernel = stride) as average-pooling footprints, the class token that joins
at the last embedding as a row of zeros (it carries nothing of the grid before), the readout the class token
(classifier) or the mean of the last grid tokens (headless); rollout / Chefer's rule as dense products at
every stage; CDAM against central differences of the model's output when a token entering a stage's last
attention is scaled; a batch against its images one by one.
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
from hier_oracle import DenseCall, assert_matches_oracle, carry, pool_matrix, taped_attention, token_derivative

transformers = pytest.importorskip("transformers")

SIZE = (64, 64)
GRIDS = [(16, 16), (8, 8), (4, 4), (2, 2)]


def build(name: str = "PvtForImageClassification", seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.PvtConfig(image_size=64, hidden_sizes=[16, 32, 48, 64], depths=[1, 2, 1, 2],
                                 num_attention_heads=[1, 2, 2, 4], num_labels=5)
    return getattr(transformers, name)(cfg).eval()


def _target(name):
    if name == "PvtForImageClassification":
        return lambda m, x: m(pixel_values=x).logits[:, 1]
    return lambda m, x: m(pixel_values=x).last_hidden_state[:, 1:].mean(1).norm(dim=-1)


def dense_chain(model, x, target):
    encoder = model.pvt.encoder if hasattr(model, "pvt") else model.encoder
    taped = iter(taped_attention(model, x, target))
    items, starts, grid = [], [], SIZE
    for s, (embed, stage) in enumerate(zip(encoder.patch_embeddings, encoder.block)):
        conv = embed.projection
        fine, grid = grid, tuple(g // conv.stride[0] for g in grid)
        prefix = int(embed.cls_token is not None)
        if s > 0:
            d = pool_matrix(fine, conv.kernel_size, conv.stride)
            items.append(torch.cat([torch.zeros(prefix, d.shape[1], dtype=torch.float64), d]))
        starts.append(len(items))
        n = prefix + grid[0] * grid[1]
        for block in stage:
            a, g = next(taped)
            attn = block.attention.self
            r = attn.sequences_reduction_ratio
            keys = pool_matrix(grid, r, r) if r > 1 else torch.eye(n, dtype=torch.float64)
            items.append(DenseCall(a, g, keys, torch.eye(n, dtype=torch.float64)))
    assert next(taped, None) is None
    u = torch.zeros(x.shape[0], n, dtype=torch.float64)
    if hasattr(model, "classifier"):
        u[:, 0] = 1.0  # the class token
    else:
        u[:, 1:] = 1.0 / (n - 1)
    return items, starts, u


@pytest.mark.parametrize("name", ["PvtForImageClassification", "PvtModel"])
def test_pvt_attention_methods_match_the_dense_float64_oracle(name):
    model = build(name)
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    target = _target(name)
    items, starts, u = dense_chain(model, x, target)
    ex = vx.Explainer(model)
    assert ex.family == "hier" and ex.adapter.layout(SIZE).grid == GRIDS[0]
    score = None if name == "PvtForImageClassification" else vx.targets.norm()
    for method in ("rollout", "generic", "grad_rollout"):
        for stage in range(4):
            e = ex.explain(x, method=method, target=score if score is not None else 1, stage=stage)
            full = carry(items, u, method, start=starts[stage])
            want = full[:, full.shape[1] - GRIDS[stage][0] * GRIDS[stage][1]:].reshape(e.maps.shape)
            assert e.maps.shape == (2, *GRIDS[stage])
            assert_matches_oracle(e.maps, want, (method, stage))


@pytest.mark.parametrize("stage", [1, 3])
def test_pvt_cdam_at_a_stage_matches_finite_differences(stage):
    """S_i = d/de y when token i (after the class token on the last stage) of the stage's last ``layer_norm_1``
    output is scaled by (1 + e)."""
    model = build().double()
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    e = vx.Explainer(model).explain(x, method="cdam", target=2, stage=stage)
    assert e.maps.shape == (1, *GRIDS[stage])
    last = len(model.pvt.encoder.block[stage]) - 1
    module = model.get_submodule(f"pvt.encoder.block.{stage}.{last}.layer_norm_1")
    prefix = int(stage == 3)
    n = GRIDS[stage][0] * GRIDS[stage][1]
    numeric = torch.tensor([token_derivative(module, (prefix + t,), lambda: model(pixel_values=x).logits[0, 2])
                            for t in range(n)], dtype=torch.float64).reshape(GRIDS[stage])
    assert float(numeric.abs().max()) > 0
    torch.testing.assert_close(e.maps[0].double(), numeric, atol=1e-6 + 1e-5 * float(numeric.abs().max()), rtol=1e-5)


def test_pvt_batch_equals_its_images_one_by_one():
    ex = vx.Explainer(build(seed=1))
    x = torch.randn(3, 3, *SIZE, generator=torch.Generator().manual_seed(4))
    for method, options in (("rollout", {}), ("generic", {}), ("generic", {"stage": 2}), ("grad_rollout", {}),
                            ("cdam", {}), ("cdam", {"stage": 0}), ("gradcam", {"stage": 1}), ("raw", {"layer": 1})):
        together = ex.explain(x, method=method, target=1, **options).maps
        alone = torch.cat([ex.explain(x[i:i + 1], method=method, target=1, **options).maps for i in range(3)])
        # (token Grad-CAM's ReLU can zero a random model's whole map; cdam reads the same site signed)
        assert together.shape[0] == 3 and (method == "gradcam" or bool(alone.abs().max() > 0)), method
        torch.testing.assert_close(together, alone, atol=1e-5 * float(alone.abs().max()) + 1e-9, rtol=1e-4)
