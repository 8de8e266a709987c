"""Efficient and smooth MPRT (Hedström et al. 2023) and the randomised copy they share with the
randomisation check: hand-computed scores, oracles, a model left as found, one seed per layer.
The comparison with Quantus is in test_metrics_quantus.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import vitexplain as vx
from vitexplain import metrics as M
from vitexplain.metrics.seeding import image_seeds


def _twin_cnn():
    """Two convolutions of the same shape, then a head: layers Quantus would give identical weights."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 3, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 4),
    )


def _grad_x_input(x, target=1):
    def explain(model, images=None):
        xi = (x if images is None else images).clone().requires_grad_(True)
        (g,) = torch.autograd.grad(model(xi)[:, target].sum(), xi)
        return (g * xi).sum(1)

    return explain


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, snapshot):
    return all(torch.equal(v, model.state_dict()[k]) for k, v in snapshot.items())


def test_randomized_copy_seeds_each_layer_and_leaves_the_model_alone():
    model = _twin_cnn()
    before, rng = _snapshot(model), torch.random.get_rng_state()
    copy = M.randomized_copy(model, seed=5)
    assert _unchanged(model, before) and torch.equal(torch.random.get_rng_state(), rng)
    assert M.randomization_layers(model) == ["6", "2", "0"]
    # the two same-shaped convolutions get different weights (seeds 5 + 1 and 5 + 2), unlike Quantus 0.6
    assert not torch.equal(copy[0].weight, copy[2].weight)
    assert all(not torch.equal(copy[i].weight, model[i].weight) for i in (0, 2, 6))
    # the copy is the last step of the cascading randomisation check with the same seed
    x = torch.randn(2, 3, 8, 8)
    check = M.randomization_check(model, _grad_x_input(x), seed=5, return_maps=True)
    assert torch.equal(check.maps[-1], _grad_x_input(x)(copy))
    assert torch.equal(M.randomized_copy(model, seed=5)[2].weight, copy[2].weight)  # seeded


def test_efficient_mprt_hand_computed():
    model = _twin_cnn()
    trained = torch.zeros(1, 4, 4)
    trained.view(-1)[8:] = 1.0  # two values: 2 of 100 bins hold 8 cells each, H = ln 2
    random = torch.arange(16.0).view(1, 4, 4)  # 16 values 6.7 bins apart: 16 bins, H = ln 16

    def explain(m):
        return trained if m is model else random

    res = M.efficient_mprt(model, explain)
    assert res.complexity.item() == pytest.approx(math.log(2))
    assert res.complexity_randomized.item() == pytest.approx(math.log(16))
    assert res.scores.item() == pytest.approx(3.0)  # (ln 16 - ln 2) / ln 2, the relative rise
    assert res.layers == ["6", "2", "0"]
    with pytest.raises(vx.UsageError, match="constant"):
        M.efficient_mprt(model, lambda m: torch.ones(2, 4, 4))


def test_efficient_mprt_explains_the_trained_model_then_the_randomised_copy():
    model = _twin_cnn()
    model.train()
    x = torch.randn(3, 3, 8, 8)
    before, rng = _snapshot(model), torch.random.get_rng_state()
    res = M.efficient_mprt(model, _grad_x_input(x), seed=3)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert torch.allclose(res.complexity, M.histogram_entropy(_grad_x_input(x)(model)))
    randomized = _grad_x_input(x)(M.randomized_copy(model, seed=3))
    assert torch.allclose(res.complexity_randomized, M.histogram_entropy(randomized))
    assert torch.allclose(res.scores, (res.complexity_randomized - res.complexity) / res.complexity)
    assert _unchanged(model, before) and model.training
    with pytest.raises(vx.UsageError, match="unknown layer"):
        M.efficient_mprt(model, _grad_x_input(x), layers=["head"])


def test_smooth_mprt_reference_is_the_mean_over_the_documented_noise():
    model = _twin_cnn().eval()
    x = torch.randn(2, 3, 8, 8)
    explain = _grad_x_input(x)
    res = M.smooth_mprt(model, explain, x, samples=4, noise=0.2, seed=9, absolute=False, return_maps=True)
    gens = [torch.Generator().manual_seed(s) for s in image_seeds(x, 9)]  # one per image, by its values
    sigma = (0.2 * (x.flatten(1).amax(1) - x.flatten(1).amin(1))).view(-1, 1, 1, 1)
    noise = [torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens]) for _ in range(4)]
    want = torch.stack([explain(model, x + sigma * eps) for eps in noise]).mean(0)
    assert torch.allclose(res.reference, want, atol=1e-6)
    assert res.layers == ["0", "2", "6"]  # bottom-up: input side first
    assert res.correlations.shape == (3, 2) and res.maps.shape == (3, 2, 8, 8)
    top = M.smooth_mprt(model, explain, x, samples=1, noise=0.0, order="top_down")
    assert top.layers == ["6", "2", "0"]


def test_smooth_mprt_without_noise_is_the_randomisation_check_bottom_up():
    model = _twin_cnn().eval()
    x = torch.randn(2, 3, 8, 8)
    smooth = M.smooth_mprt(model, _grad_x_input(x), x, samples=1, noise=0.0, seed=4)
    plain = M.randomization_check(model, _grad_x_input(x), layers=["0", "2", "6"], seed=4, absolute=True)
    assert torch.allclose(smooth.correlations, plain.correlations, atol=1e-6)


def test_smooth_mprt_uses_the_same_noise_for_every_model_state():
    # an explanation that ignores the model: with one set of noise draws for all states it never changes
    model = _twin_cnn().eval()
    x = torch.randn(2, 3, 8, 8)
    res = M.smooth_mprt(model, lambda m, images: images.sum(1), x, samples=3, noise=0.5)
    assert torch.equal(res.correlations, torch.ones(3, 2))


def test_smooth_mprt_errors_and_model_left_alone():
    model = _twin_cnn().eval()
    before = _snapshot(model)
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(vx.UsageError, match="order"):
        M.smooth_mprt(model, _grad_x_input(x), x, order="sideways")
    with pytest.raises(vx.UsageError, match="noise"):
        M.smooth_mprt(model, _grad_x_input(x), x, noise=-0.1)
    with pytest.raises(vx.UsageError, match="samples"):
        M.smooth_mprt(model, _grad_x_input(x), x, samples=0)
    with pytest.raises(vx.UsageError, match=r"\(B, C, H, W\)"):
        M.smooth_mprt(model, _grad_x_input(x), x[0])
    M.smooth_mprt(model, _grad_x_input(x), x, samples=2)
    assert _unchanged(model, before)


def test_efficient_mprt_on_the_zoo_vit():
    model = vx.zoo.load("shapes-vit").eval()
    batch = vx.data.shapes(3, seed=6)
    x, target = batch.tensor, torch.stack([c[0] for c in batch.classes])
    before = _snapshot(model)
    res = M.efficient_mprt(model, lambda m: vx.Explainer(m).explain(x, method="cdam", target=target).maps)
    assert _unchanged(model, before)
    assert res.layers[0] == "head" and res.layers[-1] == "patch_embed"
    # CDAM depends on the weights: its maps get more complex once they are random; measured
    # (torch 2.14, CPU) histogram entropies 1.43, 1.12, 1.03 -> 3.40, 3.55, 3.71: relative rises 1.4 to 2.6
    assert bool((res.scores > 0.5).all())
