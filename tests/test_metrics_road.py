"""ROAD (Rong et al. 2022): noisy linear imputation and the MoRF / LeRF curves, against hand-computed
cases, invariants and the bundled shapes-vit. The comparison with Quantus (and the paper's imputation
code it carries) is in test_metrics_quantus.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import vitexplain as vx
from vitexplain import metrics as M

WEIGHTS = torch.tensor([[1 / 12, 1 / 6, 1 / 12], [1 / 6, 0.0, 1 / 6], [1 / 12, 1 / 6, 1 / 12]], dtype=torch.float64)


def test_one_removed_pixel_is_the_weighted_mean_of_its_neighbours():
    x = torch.rand(1, 2, 5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    removed = torch.zeros(1, 5, 6, dtype=torch.bool)
    removed[0, 2, 3] = True
    out = M.noisy_linear_imputation(x, removed, noise=0.0)
    want = (x[0, :, 1:4, 2:5] * WEIGHTS).sum((1, 2))  # the 8 weights sum to 1 inside the image
    assert torch.allclose(out[0, :, 2, 3], want, atol=1e-12)
    assert torch.equal(out[~removed[:, None].expand_as(x)], x[~removed[:, None].expand_as(x)])  # kept pixels
    # at the corner only 3 neighbours are inside: (1/6 x[0,1] + 1/6 x[1,0] + 1/12 x[1,1]) / (5/12)
    removed = torch.zeros(1, 5, 6, dtype=torch.bool)
    removed[0, 0, 0] = True
    out = M.noisy_linear_imputation(x, removed, noise=0.0)
    corner = (2 * x[0, :, 0, 1] + 2 * x[0, :, 1, 0] + x[0, :, 1, 1]) / 5
    assert torch.allclose(out[0, :, 0, 0], corner, atol=1e-12)


def test_two_adjacent_removed_pixels_are_solved_jointly():
    # a constant-1 image with two removed neighbours (2, 2) and (2, 3): each is the weighted mean of
    # its neighbours including the other unknown; the unique solution is 1 for both
    x = torch.ones(1, 1, 5, 6)
    removed = torch.zeros(1, 5, 6, dtype=torch.bool)
    removed[0, 2, 2:4] = True
    assert torch.allclose(M.noisy_linear_imputation(x, removed, noise=0.0), x, atol=1e-6)
    # a linear ramp along the columns is harmonic for these symmetric weights: it is filled exactly
    ramp = torch.arange(6.0).expand(1, 1, 5, 6).clone()
    block = torch.zeros(1, 5, 6, dtype=torch.bool)
    block[0, 1:4, 1:5] = True
    assert torch.allclose(M.noisy_linear_imputation(ramp, block, noise=0.0), ramp, atol=1e-5)


def test_imputation_noise_is_gaussian_on_the_removed_pixels_only():
    x = torch.zeros(1, 2, 64, 64)
    removed = torch.zeros(1, 64, 64, dtype=torch.bool)
    removed[0, 8:56, 8:56] = True  # 2304 pixels per channel, filled with 0 plus noise
    g = torch.Generator().manual_seed(0)
    out = M.noisy_linear_imputation(x, removed, noise=[0.01, 0.2], generator=g)
    inside = out[0][:, removed[0]]
    assert torch.equal(out[0][:, ~removed[0]], torch.zeros(2, 64 * 64 - 2304))
    # the sample sd of 2304 normal draws is within 4 x sd / sqrt(2 * 2304) of the true sd
    for c, std in enumerate((0.01, 0.2)):
        assert inside[c].std().item() == pytest.approx(std, rel=4 / math.sqrt(2 * 2304))
    again = M.noisy_linear_imputation(x, removed, noise=[0.01, 0.2], generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_imputation_errors():
    x = torch.rand(2, 3, 4, 4)
    with pytest.raises(vx.UsageError, match="every pixel"):
        M.noisy_linear_imputation(x, torch.ones(2, 4, 4, dtype=torch.bool))
    with pytest.raises(vx.UsageError, match="removed must have shape"):
        M.noisy_linear_imputation(x, torch.zeros(2, 5, 4, dtype=torch.bool))
    with pytest.raises(vx.UsageError, match="noise"):
        M.noisy_linear_imputation(x, torch.zeros(2, 4, 4, dtype=torch.bool), noise=[0.1, 0.1])
    with pytest.raises(vx.UsageError, match="noise"):
        M.noisy_linear_imputation(x, torch.zeros(2, 4, 4, dtype=torch.bool), noise=-1.0)


class _Sum(nn.Module):
    """logits = (sum of the image, 0): the score of class 0 is the image's total."""

    def forward(self, x):
        total = x.flatten(1).sum(1)
        return torch.stack([total, torch.zeros_like(total)], 1)


def _sum():
    return _Sum().eval()


def test_road_curves_hand_computed():
    # an 8x8 image: a bright 4x4 square (1) on a black background (0), and the square as the map
    x = torch.zeros(1, 1, 8, 8)
    x[0, 0, 2:6, 2:6] = 1.0
    square = x[:, 0].clone()
    raw = lambda z: z  # noqa: E731 - record the raw logit
    morf = M.road(_sum(), x, square, 0, fractions=[0.0, 0.25], noise=0.0, score=raw)
    # nothing removed: 16; the square removed (16 / 64 = 0.25) and filled from the black border: 0
    assert morf.curves[0].tolist() == [pytest.approx(16.0), pytest.approx(0.0, abs=1e-4)]
    lerf = M.road(_sum(), x, square, 0, order="lerf", fractions=[0.75], noise=0.0, score=raw)
    # the black background removed (48 px) and filled from the square: 1 everywhere, total 64
    assert lerf.curves[0].tolist() == [pytest.approx(64.0, abs=1e-3)]
    assert lerf.order == "lerf" and lerf.fractions.tolist() == [0.75] and lerf.targets.tolist() == [0]
    assert bool(morf.correct[0, 0])  # 16 > 0: class 0 is still on top


def test_road_ties_are_broken_at_random_by_the_seed_and_batch_size_does_not_matter():
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(3, 1, 8, 8, generator=gen)
    flat = torch.zeros(3, 8, 8)  # every pixel tied: which ones go first is the seeded random order
    runs = [M.road(_sum(), x, flat, 0, fractions=[0.5], noise=0.0, score=lambda z: z, seed=s) for s in (0, 0, 1)]
    assert torch.equal(runs[0].curves, runs[1].curves)
    assert not torch.allclose(runs[0].curves, runs[2].curves)
    maps = torch.rand(3, 4, 4, generator=gen)
    kwargs = dict(fractions=[0.1, 0.4, 0.7], noise=0.05, score=lambda z: z, seed=3)
    whole = M.road(_sum(), x, maps, 0, batch_size=64, **kwargs)
    chunked = M.road(_sum(), x, maps, 0, batch_size=2, **kwargs)
    # the noise and tie order are drawn per (item, fraction); the solver stops when the whole chunk has
    # converged, so chunks differ only below its tolerance
    assert torch.allclose(whole.curves, chunked.curves, atol=1e-4) and torch.equal(whole.correct, chunked.correct)


def test_road_errors_and_training_warning():
    x = torch.rand(2, 1, 8, 8)
    maps = torch.rand(2, 8, 8)
    for bad in ([1.0], [-0.1], []):
        with pytest.raises(vx.UsageError, match="fractions"):
            M.road(_sum(), x, maps, 0, fractions=bad)
    with pytest.raises(vx.UsageError, match="order"):
        M.road(_sum(), x, maps, 0, order="random")
    with pytest.raises(vx.UsageError, match="batch_size"):
        M.road(_sum(), x, maps, 0, batch_size=0)
    with pytest.raises(vx.UsageError, match="noise"):
        M.road(_sum(), x, maps, 0, noise=[0.1, 0.1, 0.1])
    with pytest.raises(vx.UsageError, match=r"\(B, C, H, W\)"):
        M.road(_sum(), x[0], maps, 0)
    with pytest.raises(vx.TargetError):
        M.road(_sum(), x, maps, 5)
    with pytest.warns(UserWarning, match="training mode"):
        M.road(_Sum(), x, maps, 0, fractions=[0.5])


def test_road_on_the_zoo_vit_morf_falls_and_lerf_holds():
    model = vx.zoo.load("shapes-vit").eval()
    batch = vx.data.shapes(2, seed=7, num_objects=1)
    x, target = batch.tensor, torch.stack([c[0] for c in batch.classes])
    maps = vx.Explainer(model).explain(x, method="generic", target=target).maps
    noise = [0.01 / s for s in vx.data.STD]  # the paper's 0.01 on [0, 1] pixels, in normalised units
    kwargs = dict(fractions=[0.0, 0.5], noise=noise, score="sigmoid")
    morf = M.road(model, x, maps, target, **kwargs)
    lerf = M.road(model, x, maps, target, order="lerf", **kwargs)
    with torch.no_grad():
        unmodified = torch.sigmoid(model(x)).gather(1, target[:, None])[:, 0]
    assert torch.allclose(morf.curves[:, 0], unmodified) and torch.allclose(lerf.curves[:, 0], unmodified)
    # Chefer's relevance (generic) finds the object: on 6 images (seed 7) removing 20 % or 50 % of the
    # pixels MoRF left sigmoid scores of 0.000 to 0.004, LeRF 0.997 to 0.999 (torch 2.14, CPU)
    assert bool((morf.curves[:, 1:] < 0.1).all()) and bool((lerf.curves[:, 1:] > 0.9).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_new_metrics_run_on_cuda_as_on_cpu():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 32, 32, generator=gen)
    maps = torch.rand(2, 8, 8, generator=gen)
    masks = torch.rand(2, 32, 32, generator=gen) < 0.3
    removed = torch.rand(2, 32, 32, generator=gen) < 0.6
    on_gpu = M.noisy_linear_imputation(x.to(dev), removed.to(dev), noise=0.0)
    assert on_gpu.device.type == "cuda"
    assert torch.allclose(on_gpu.cpu(), M.noisy_linear_imputation(x, removed, noise=0.0), atol=1e-5)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4)).eval()
    cpu = M.road(model, x, maps, 1, noise=0.0, fractions=[0.2, 0.6])
    gpu = M.road(model.to(dev), x.to(dev), maps.to(dev), 1, noise=0.0, fractions=[0.2, 0.6])
    assert gpu.curves.device.type == "cuda" and torch.allclose(gpu.curves.cpu(), cpu.curves, atol=1e-4)
    for f in (M.sparseness, M.complexity, M.histogram_entropy):
        assert torch.allclose(f(maps.to(dev)).cpu(), f(maps), atol=1e-6)
    assert torch.allclose(M.relevance_rank_accuracy(maps.to(dev), masks.to(dev)).cpu(), M.relevance_rank_accuracy(maps, masks))
    explain = lambda images: (images ** 2).sum(1)  # noqa: E731
    assert M.avg_sensitivity(explain, x.to(dev), samples=3).device.type == "cuda"
