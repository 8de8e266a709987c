"""Max- and avg-sensitivity (Yeh et al. 2019) against hand-computed cases, an oracle that redraws the
documented noise, and the bundled shapes-vit. The comparison with Quantus is in test_metrics_quantus.py."""

from __future__ import annotations

import math

import pytest
import torch

import vitexplain as vx
from vitexplain import metrics as M
from vitexplain.metrics.seeding import image_seeds


def _images(b=3, c=2, size=32, seed=0):
    return torch.rand(b, c, size, size, generator=torch.Generator().manual_seed(seed)) + 0.5


def test_a_constant_explanation_has_zero_sensitivity():
    x = _images()
    fixed = torch.rand(3, 4, 4) + 0.1
    explain = lambda images: fixed  # noqa: E731 - ignores its input
    assert torch.equal(M.max_sensitivity(explain, x, samples=5), torch.zeros(3))
    assert torch.equal(M.avg_sensitivity(explain, x, samples=5), torch.zeros(3))


def test_linear_explanation_matches_the_oracle_and_the_expected_norm():
    x = _images()
    radius, samples, seed = 0.1, 200, 7
    explain = lambda images: 3.0 * images[:, 0]  # noqa: E731 - Phi(x) = 3 x_0, so Phi(x + d) - Phi(x) = 3 d_0
    got = M.sensitivities(explain, x, radius=radius, samples=samples, seed=seed)
    # oracle: redraw the documented noise, one torch.rand(image.shape) per sample from each image's generator
    gens = [torch.Generator().manual_seed(s) for s in image_seeds(x, seed)]
    deltas = torch.stack([torch.stack([(2 * torch.rand(x.shape[1:], generator=g) - 1) * radius for g in gens])
                          for _ in range(samples)])
    want = deltas[:, :, 0].flatten(2).norm(dim=2) / x[:, 0].flatten(1).norm(dim=1)
    assert torch.allclose(got, want, rtol=1e-5)
    assert torch.equal(M.max_sensitivity(explain, x, radius=radius, samples=samples, seed=seed), got.amax(0))
    assert torch.equal(M.avg_sensitivity(explain, x, radius=radius, samples=samples, seed=seed), got.mean(0))
    # hand-computed: d uniform in [-r, r] has E d^2 = r^2 / 3, so E ||d_0|| ~ r sqrt(n / 3) for n = 1024 cells
    # (Jensen gap ~1e-4 relative); one sample's ||d_0|| has relative sd 0.014, the mean of 200: SE 0.001
    expected = radius * math.sqrt(32 * 32 / 3) / x[:, 0].flatten(1).norm(dim=1)
    assert torch.allclose(got.mean(0), expected, rtol=4 * 0.001 + 1e-4)
    bound = radius * 32 / x[:, 0].flatten(1).norm(dim=1)  # ||d_0|| <= r sqrt(n): the L-inf ball's corner
    assert bool((got <= bound * (1 + 1e-6)).all())


def test_relative_is_scale_free_and_absolute_is_the_papers_norm():
    x = _images()
    explain = lambda images: images[:, 1] ** 2  # noqa: E731
    scaled = lambda images: 10.0 * images[:, 1] ** 2  # noqa: E731
    rel = M.avg_sensitivity(explain, x, samples=4)
    assert torch.allclose(M.avg_sensitivity(scaled, x, samples=4), rel, rtol=1e-5)
    absolute = M.avg_sensitivity(explain, x, samples=4, relative=False)
    assert torch.allclose(M.avg_sensitivity(scaled, x, samples=4, relative=False), 10 * absolute, rtol=1e-5)
    assert torch.allclose(absolute, rel * explain(x).flatten(1).norm(dim=1), rtol=1e-5)


def test_sensitivity_inputs_are_checked():
    x = _images()
    zero = lambda images: torch.zeros(3, 4, 4)  # noqa: E731
    with pytest.raises(vx.UsageError, match="all zero"):
        M.max_sensitivity(zero, x, samples=2)
    assert M.max_sensitivity(zero, x, samples=2, relative=False).tolist() == [0.0] * 3
    with pytest.raises(vx.UsageError, match="radius"):
        M.avg_sensitivity(lambda images: images[:, 0], x, radius=0)
    with pytest.raises(vx.UsageError, match="samples"):
        M.avg_sensitivity(lambda images: images[:, 0], x, samples=0)
    calls = iter([torch.rand(3, 4, 4), torch.rand(3, 5, 5)])
    with pytest.raises(vx.UsageError, match="perturbed"):
        M.avg_sensitivity(lambda images: next(calls), x, samples=1)
    with pytest.raises(vx.UsageError, match="NaN"):
        M.avg_sensitivity(lambda images: torch.full((3, 4, 4), math.nan), x, samples=1)


def test_sensitivity_of_a_zoo_explainer_grows_with_the_radius():
    model = vx.zoo.load("shapes-vit").eval()
    batch = vx.data.shapes(2, seed=4)
    x, target = batch.tensor, torch.stack([c[0] for c in batch.classes])
    ex = vx.Explainer(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    explain = lambda images: ex.explain(images, method="cdam", target=target).maps  # noqa: E731
    maps = explain(x)
    tiny = M.max_sensitivity(explain, x, radius=1e-4, samples=2, maps=maps)
    large = M.max_sensitivity(explain, x, radius=0.5, samples=2, maps=maps)
    # measured (torch 2.14, CPU, 3 samples): 3e-5 and 5e-5 at radius 1e-4, 0.33 and 0.75 at radius 0.5
    assert bool((tiny < 0.05).all()) and bool((large > 10 * tiny).all())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
