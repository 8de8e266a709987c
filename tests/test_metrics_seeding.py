"""The random metrics (ROAD's imputation noise and tie order, max/avg-sensitivity's input noise, smooth
MPRT's input noise) draw each image's randomness from its own content and the seed: an image's score does
not depend on where it stands in the batch or on what else is in it, so a batch scores as its images one
by one (the project's batching rule) and a data set scores the same in chunks of any size."""

from __future__ import annotations

import torch
from torch import nn

from vitexplain import metrics as M


def _images(b: int = 3, c: int = 2, s: int = 8) -> torch.Tensor:
    return torch.rand(b, c, s, s, generator=torch.Generator().manual_seed(7))


def _one_by_one(fn, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i : i + 1], *(r[i : i + 1] for r in rest)) for i in range(len(x))])


def test_road_scores_an_image_the_same_wherever_it_stands():
    x = _images()
    maps = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(8))
    maps[1] = 0.5  # all tied: the seeded random tie order decides
    model = nn.Sequential(nn.Flatten(), nn.Linear(2 * 64, 3))
    torch.manual_seed(0)
    nn.init.normal_(model[1].weight)

    def road(images, m):
        return M.road(model, images, m, 0, fractions=[0.2, 0.5], noise=0.05, score=lambda z: z, seed=4).curves

    whole = road(x, maps)
    # the solver stops when the whole chunk has converged: agreement to its tolerance
    assert torch.allclose(whole, _one_by_one(road, x, maps), atol=1e-4)
    assert torch.allclose(whole.flip(0), road(x.flip(0), maps.flip(0)), atol=1e-4)
    assert not torch.allclose(whole, M.road(model, x, maps, 0, fractions=[0.2, 0.5], noise=0.05,
                                            score=lambda z: z, seed=5).curves, atol=1e-3)  # the seed matters


def test_sensitivity_scores_an_image_the_same_wherever_it_stands():
    x = _images()
    w = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(9))

    def explain(images):  # deterministic and per image: any batch dependence comes from the noise
        return torch.tanh(3 * images * w).sum(1)

    for metric in (M.max_sensitivity, M.avg_sensitivity):
        def score(images):
            return metric(explain, images, radius=0.1, samples=6, seed=2)

        whole = score(x)
        assert torch.allclose(whole, _one_by_one(score, x), rtol=1e-6)
        assert torch.allclose(whole.flip(0), score(x.flip(0)), rtol=1e-6)


def test_smooth_mprt_scores_an_image_the_same_wherever_it_stands():
    x = _images(c=3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 64, 2))

    def explain(m, images):
        images = images.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(m(images)[:, 1].sum(), images)
        return (g * images).sum(1)

    def run(images):
        return M.smooth_mprt(model, explain, images, samples=4, noise=0.1, seed=1)

    whole = run(x)
    alone = [run(x[i : i + 1]) for i in range(3)]
    assert torch.allclose(whole.reference, torch.cat([a.reference for a in alone]), rtol=1e-5, atol=1e-7)
    assert torch.allclose(whole.correlations, torch.cat([a.correlations for a in alone], dim=1), atol=1e-6)


def test_bad_seeds_and_empty_batches_are_usage_errors():
    """A seed that is not an int (None, 0.5: silently truncated to 0) and a batch of no images (a raw
    torch.cat / reshape error deep inside) are told apart from a working call with a clear message."""
    import pytest

    from vitexplain.errors import UsageError

    x = _images()
    model = nn.Sequential(nn.Flatten(), nn.Linear(2 * 64, 3))
    maps = torch.rand(3, 4, 4)
    for seed in (None, 0.5, True):
        with pytest.raises(UsageError, match="seed"):
            M.max_sensitivity(lambda z: z.sum(1), x, samples=2, seed=seed)
        with pytest.raises(UsageError, match="seed"):
            M.smooth_mprt(model, lambda m, z: z.sum(1), x, samples=1, seed=seed)
    for call in (lambda: M.deletion_auc(model, x[:0], maps[:0]), lambda: M.road(model, x[:0], maps[:0]),
                 lambda: M.avg_sensitivity(lambda z: z.sum(1), x[:0], samples=2)):
        with pytest.raises(UsageError, match="no images"):
            call()
