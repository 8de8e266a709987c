"""Hugging Face LeViT and SAM 2's Hiera backbone: the footprint rule against dense float64 oracles
built here from an eager float64 copy's own softmax outputs (taped, tests/hier_oracle.py), with
the layer order read from the models' module trees; CDAM against finite differences; a batch
against its images one by one.

LeViT: per stage its attention layers on one grid (identity keys and residual), then the
subsampling attention whose queries are every other row and column of the grid and whose keys
are the whole grid, with no residual.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vitexplain as vx
from hier_oracle import DenseCall, assert_matches_oracle, carry, taped_attention, token_derivative

transformers = pytest.importorskip("transformers")

import support_table as support  # noqa: E402
from sam2_checks import check_batch_equals_one_by_one, check_dense_oracle, dense_calls  # noqa: E402

LEVIT_SIZE = (128, 128)


def levit(kind: str = "classifier", depths=(1, 2, 1)) -> nn.Module:
    """A tiny random-init Hugging Face LeViT at 128 px (grids 8 x 8, 4 x 4, 2 x 2), linear and conv
    weights N(0, 1 / fan_in) and attention biases N(0, 1): Hugging Face's init (std 0.02, zero
    attention biases) makes every attention near uniform and the last stage's tokens near identical."""
    torch.manual_seed(0)
    cls = {"classifier": "LevitForImageClassification", "teacher": "LevitForImageClassificationWithTeacher",
           "headless": "LevitModel"}[kind]
    return support._hf_levit(cls, depths)().eval()


VECTOR = torch.randn(64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _logit(model, x):
    return model(pixel_values=x).logits[:, 1]


def _pooled_score(model, x):  # headless: a projection of the mean of the last tokens
    return model(pixel_values=x).last_hidden_state.mean(dim=1) @ VECTOR.to(x.dtype)


def _eye(n):
    return torch.eye(n, dtype=torch.float64)


def levit_dense(model, x, score):
    """(items, index of the first item on the last grid, last grid); the grid halves (rounding up)
    at each subsampling attention, read from the module tree."""
    taped = iter(taped_attention(model, x, score))
    base = getattr(model, "levit", model)
    grid = (LEVIT_SIZE[0] // 16, LEVIT_SIZE[1] // 16)
    items, last_start = [], 0
    for stage in base.encoder.stages:
        for layer in stage.layers:
            name = type(getattr(layer, "module", layer)).__name__
            if name == "LevitAttention":
                a, g = next(taped)
                n = grid[0] * grid[1]
                assert a.shape[-2:] == (n, n)
                items.append(DenseCall(a, g, _eye(n), _eye(n)))
            elif name == "LevitAttentionSubsample":
                a, g = next(taped)
                n_in = grid[0] * grid[1]
                grid = ((grid[0] + 1) // 2, (grid[1] + 1) // 2)
                assert a.shape[-2:] == (grid[0] * grid[1], n_in)
                items.append(DenseCall(a, g, _eye(n_in), None))
                last_start = len(items)
    return items, last_start, grid


@pytest.mark.parametrize("kind", ["classifier", "teacher", "headless"])
def test_hugging_face_levit_matches_the_dense_float64_oracle(kind):
    model = levit(kind)
    x = torch.randn(2, 3, *LEVIT_SIZE, generator=torch.Generator().manual_seed(1))
    score = _pooled_score if kind == "headless" else _logit
    items, last_start, grid = levit_dense(model, x, score)
    ex = vx.Explainer(model)
    assert ex.family == "hier" and type(ex.adapter).__name__ == "HFLeViTAdapter"
    target = (lambda pooled: pooled @ VECTOR.float()) if kind == "headless" else 1
    n = grid[0] * grid[1]
    u = torch.full((2, n), 1.0 / n, dtype=torch.float64)
    # headless: the score's gradient on the last (residual-free) call can be negative everywhere, so
    # grad_rollout (positive part) is 0 there, in the oracle as in vitexplain; the classifiers check it
    methods = ["rollout", "generic"] + (["grad_rollout"] if kind != "headless" else [])
    for method, e in zip(methods, ex.explain(x, method=methods, target=target)):
        want = carry(items, u, method).view(e.maps.shape)
        assert e.maps.shape == (2, 8, 8) == (2, *e.layout.grid), method
        assert e.layout.patch_size == (16, 16)
        assert_matches_oracle(e.maps, want, method)
    e = ex.explain(x, method="generic", target=target, stage=-1)
    want = carry(items, u, "generic", start=last_start).view(e.maps.shape)
    assert e.maps.shape == (2, *grid)
    assert float((e.maps.double() - want).abs().max()) <= 1e-4 * float(want.abs().max())  # (LeViT's is all 0 here)


def test_hugging_face_levit_batch_equals_its_images_one_by_one():
    model = levit()
    x = torch.randn(3, 3, *LEVIT_SIZE, generator=torch.Generator().manual_seed(2))
    ex = vx.Explainer(model)
    for method, options in (("rollout", {}), ("generic", {}), ("grad_rollout", {"stage": 1}), ("cdam", {}),
                            ("cdam", {"stage": 0}), ("raw", {"layer": 1})):
        together = ex.explain(x, method=method, target=2, **options).maps
        alone = torch.cat([ex.explain(x[i:i + 1], method=method, target=2, **options).maps for i in range(3)])
        assert together.shape[0] == 3
        torch.testing.assert_close(together, alone, atol=1e-5 * float(alone.abs().max()) + 1e-9, rtol=1e-4)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_hugging_face_levit_cdam_matches_finite_differences(stage):
    """S_i = d/de y when token i of the tokens entering the stage's last attention layer is scaled
    by (1 + e): stage 0's are the patch embedding's output (its one layer is first), stage 1's the
    MLP layer's before its second attention layer, stage 2's the previous stage's output."""
    model = levit().double()
    x = torch.randn(1, 3, *LEVIT_SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    e = vx.Explainer(model).explain(x, method="cdam", target=0, stage=stage)
    grid = [(8, 8), (4, 4), (2, 2)][stage]
    assert e.maps.shape == (1, *grid)
    module = model.get_submodule(["levit.patch_embeddings", "levit.encoder.stages.1.layers.1",
                                  "levit.encoder.stages.1"][stage])
    n = grid[0] * grid[1]
    for t in torch.randperm(n, generator=torch.Generator().manual_seed(0))[:8].tolist():
        numeric = token_derivative(module, (t,), lambda: model(pixel_values=x).logits[0, 0])
        got = float(e.maps[0, t // grid[1], t % grid[1]])
        assert abs(got - numeric) <= 1e-6 + 1e-5 * abs(numeric), (t, got, numeric)


# -- SAM 2's Hiera backbone --------------------------------------------------------------------
SAM2_SIZE = (64, 64)
SAM2_VECTOR = torch.randn(64, generator=torch.Generator().manual_seed(6), dtype=torch.float64)


def sam2() -> nn.Module:
    """support_table's tiny SAM 2 backbone (windows, pooled windows, zero-padded windows, global)."""
    torch.manual_seed(0)
    model = transformers.Sam2HieraDetModel(support.hf_sam2_hiera_config())
    with torch.no_grad():  # unit-ish gain for every weight matrix (as tests/test_hier_hf.py does for SAM)
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / p[0].numel() ** 0.5)
    return model.eval()


def _sam2_score(model, x):
    return model(pixel_values=x).last_hidden_state.mean(dim=(1, 2)) @ SAM2_VECTOR.to(x.dtype)


def _sam2_target(pooled):
    return pooled @ SAM2_VECTOR.to(pooled.dtype)


def _used_softmax(model, x, score):
    """(A, dy/dA) of the softmaxes of an eager float64 copy that reach the output: Hugging Face's
    ``Sam2MultiScaleAttention`` also computes a softmax it never uses (no gradient), then the
    attention function's own."""
    from hier_oracle import SoftmaxTape

    eager = copy.deepcopy(model).double().eval()
    eager.set_attn_implementation("eager")
    tape = SoftmaxTape()
    with tape:
        y = score(eager, x.double())
    y.sum().backward()
    used = [(a.detach(), a.grad.detach().to(a.dtype)) for a in tape.outputs if a.grad is not None]
    assert len(used) == len(model.blocks) and len(tape.outputs) == 2 * len(model.blocks)
    return used


def _partition_index(grid, window):
    """(nW, window^2) grid index of each window slot, -1 = padding: the model's own window_partition
    of token indices (+1, so padding reads 0)."""
    from transformers.models.sam2.modeling_sam2 import window_partition

    n = grid[0] * grid[1]
    idx, _ = window_partition((torch.arange(n) + 1).view(1, *grid, 1).double(), window)
    return idx.reshape(idx.shape[0], -1).round().long() - 1


def _unpartition_index(coarse, window, windows):
    """(nW, window^2) coarse-grid index of each pooled query slot, -1 = cropped: the model's own
    window_unpartition of slot numbers."""
    from transformers.models.sam2.modeling_sam2 import window_unpartition

    pad = tuple(g + (-g) % window for g in coarse)
    slots = (torch.arange(windows * window * window) + 1).double().view(windows, window, window, 1)
    placed = window_unpartition(slots, window, pad, coarse).reshape(-1).round().long() - 1  # slot at each coarse token
    index = torch.full((windows * window * window,), -1, dtype=torch.long)
    index[placed] = torch.arange(placed.numel())
    return index.view(windows, -1)


def sam2_dense(model, x):
    """Dense calls on each stage's row-major grid, forward order; the last grid."""
    used = _used_softmax(model, x, _sam2_score)
    return dense_calls(used, model.blocks, x.shape[0], lambda b: (b.window_size, b.window_size), lambda b: bool(b.query_stride),
                       lambda grid, window: _partition_index(grid, window[0]),
                       lambda coarse, window, windows: _unpartition_index(coarse, window[0], windows))


def test_sam2_hiera_backbone_matches_the_dense_float64_oracle():
    model = sam2()
    x = torch.randn(2, 3, *SAM2_SIZE, generator=torch.Generator().manual_seed(1))
    items, grid = sam2_dense(model, x)
    ex = vx.Explainer(model)
    assert ex.family == "hier" and type(ex.adapter).__name__ == "HFSam2HieraAdapter"
    check_dense_oracle(ex, x, items, grid, _sam2_target)


def test_sam2_hiera_backbone_batch_equals_its_images_one_by_one():
    model = sam2()
    x = torch.randn(3, 3, *SAM2_SIZE, generator=torch.Generator().manual_seed(2))
    check_batch_equals_one_by_one(vx.Explainer(model), x, _sam2_target)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_sam2_hiera_backbone_cdam_matches_finite_differences(stage):
    """S_(i,j) = d/de score when token (i, j) of the (B, H, W, C) tokens entering the last attention
    reading the stage's grid is scaled by (1 + e): block 1's (pools stage 0), block 3's (pools
    stage 1), block 5's."""
    model = sam2().double()
    x = torch.randn(1, 3, *SAM2_SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    e = vx.Explainer(model).explain(x, method="cdam", target=_sam2_target, stage=stage)
    grid = [(16, 16), (8, 8), (4, 4)][stage]
    assert e.maps.shape == (1, *grid)
    module = model.get_submodule(f"blocks.{[1, 3, 5][stage]}.layer_norm1")
    for t in torch.randperm(grid[0] * grid[1], generator=torch.Generator().manual_seed(0))[:8].tolist():
        i, j = divmod(t, grid[1])
        numeric = token_derivative(module, (i, j), lambda: _sam2_score(model, x)[0])
        got = float(e.maps[0, i, j])
        assert abs(got - numeric) <= 1e-6 + 1e-5 * abs(numeric), (t, got, numeric)


def test_sam2_vision_model_is_refused_with_the_reason_and_its_backbone_is_explained():
    config = transformers.Sam2VisionConfig(backbone_config=support.hf_sam2_hiera_config(), backbone_channel_list=[64, 32, 16],
                                           fpn_hidden_size=16)
    torch.manual_seed(0)
    model = transformers.Sam2VisionModel(config).eval()
    with pytest.raises(vx.UnsupportedModelError, match=r"FPN neck fuses the feature maps.*model\.backbone"):
        vx.Explainer(model)
    e = vx.Explainer(model.backbone).explain(torch.randn(2, 3, *SAM2_SIZE), method="generic", target=vx.targets.norm())
    assert e.maps.shape == (2, 16, 16) == (2, *e.layout.grid)
    full = transformers.Sam2Model(transformers.Sam2Config(vision_config=config))
    with pytest.raises(vx.UnsupportedModelError, match=r"masks decoded from prompts.*FPN neck.*model\.vision_encoder\.backbone"):
        vx.Explainer(full)
