"""Metrics of a map against a mask or of the map alone, against hand-computed cases and invariants:
relevance rank accuracy, top-k intersection (ties by expectation), sparseness (Gini), complexity
(entropy) and histogram entropy. The peer comparison with Quantus is in test_metrics_quantus.py."""

from __future__ import annotations

import math

import pytest
import torch

import vitexplain as vx
from vitexplain import metrics as M


def _corner_mask(size=4, side=2):
    m = torch.zeros(1, size, size, dtype=torch.bool)
    m[0, :side, :side] = True
    return m


# ------------------------------------------------------------------------------------------------
# relevance rank accuracy, top-k intersection
# ------------------------------------------------------------------------------------------------


def test_rank_accuracy_and_top_k_hand_computed():
    mask = _corner_mask()  # pixels 0, 1, 4, 5 of a 4x4 image
    ramp = torch.arange(16.0).view(1, 4, 4)  # pixel i has relevance i
    assert M.relevance_rank_accuracy(ramp, mask).tolist() == [0.0]  # top 4 = 12..15, none inside
    assert M.relevance_rank_accuracy(-ramp, mask).tolist() == [0.5]  # top 4 = 0..3: 0, 1 inside
    assert M.top_k_intersection(-ramp, mask, 2).tolist() == [1.0]  # 0, 1
    assert M.top_k_intersection(-ramp, mask, 6).tolist() == [pytest.approx(4 / 6)]  # 0..5: 0, 1, 4, 5
    assert M.top_k_intersection(-ramp, mask, 16).tolist() == [0.25]  # every pixel: |mask| / 16


def test_rank_accuracy_of_the_mask_itself_is_one_and_of_a_constant_map_chance():
    gen = torch.Generator().manual_seed(0)
    masks = torch.rand(5, 24, 24, generator=gen) < 0.3
    assert M.relevance_rank_accuracy(masks.float(), masks).tolist() == [1.0] * 5
    assert M.relevance_rank_accuracy(masks.float() * 7 - 3, masks).tolist() == [1.0] * 5  # affine invariant
    chance = masks.flatten(1).float().mean(1)
    got = M.relevance_rank_accuracy(torch.zeros(5, 24, 24), masks)
    assert torch.allclose(got, chance, atol=1e-6)
    assert torch.allclose(M.top_k_intersection(torch.zeros(5, 24, 24), masks, 50), chance, atol=1e-6)


def test_ties_at_the_cut_count_by_expectation():
    # a ReLU-clamped map: 3 positive pixels (2 inside), the other 13 tied at 0 (2 of them inside);
    # K = 4: the 3 positives, then 1 of the 13 zeros drawn at random, inside with probability 2/13
    mask = _corner_mask()
    m = torch.zeros(1, 4, 4)
    m[0, 0, 0], m[0, 0, 1], m[0, 3, 3] = 3.0, 2.0, 1.0
    assert M.relevance_rank_accuracy(m, mask).item() == pytest.approx((2 + 2 / 13) / 4)
    # the expectation is what a random order of the tied pixels gives on average
    mean = 0.0
    gen = torch.Generator().manual_seed(0)
    draws = 2000
    for _ in range(draws):
        order = torch.randperm(16, generator=gen)
        broken = m.flatten().clone()
        broken[order] += torch.arange(16) * 1e-6 * (broken[order] == 0)
        mean += M.relevance_rank_accuracy(broken.view(1, 4, 4), mask).item() / draws
    # the per-draw score is 0.5 or 0.75 (sd 0.090): mean within 4 SE of the expectation
    assert mean == pytest.approx((2 + 2 / 13) / 4, abs=4 * 0.090 / math.sqrt(draws))


def test_rank_metrics_upsample_the_map_to_the_mask():
    grid = torch.zeros(1, 2, 2)
    grid[0, 0, 0] = 1.0  # x8 bilinear: a 4x4 plateau of 1 in the top-left corner, falling off from there
    mask = torch.zeros(1, 16, 16, dtype=torch.bool)
    mask[0, :4, :4] = True
    assert M.relevance_rank_accuracy(grid, mask).tolist() == [1.0]
    assert M.top_k_intersection(grid, mask, 32).tolist() == [0.5]
    mask[0, :8, :8] = True  # the 36 highest upsampled values all lie in the top-left quadrant
    assert M.top_k_intersection(grid, mask, 36).tolist() == [1.0]


def test_rank_metrics_errors():
    mask = _corner_mask()
    with pytest.raises(vx.UsageError, match="empty"):
        M.relevance_rank_accuracy(torch.rand(2, 4, 4), torch.cat([mask, torch.zeros_like(mask)]))
    assert M.top_k_intersection(torch.rand(1, 4, 4), torch.zeros_like(mask), 3).tolist() == [0.0]
    for k in (0, 17, 2.5, True):
        with pytest.raises(vx.UsageError, match="k must be"):
            M.top_k_intersection(torch.rand(1, 4, 4), mask, k)
    with pytest.raises(vx.UsageError, match="NaN"):
        M.relevance_rank_accuracy(torch.full((1, 4, 4), math.nan), mask)


# ------------------------------------------------------------------------------------------------
# sparseness (Gini index), complexity (entropy), histogram entropy
# ------------------------------------------------------------------------------------------------


def _four_cells():
    """A 4x4 map with 12 zeros and |values| 1, 1, 2, 4 (signs do not matter)."""
    m = torch.zeros(1, 4, 4)
    m.view(-1)[[3, 7, 9, 12]] = torch.tensor([1.0, -1.0, 2.0, -4.0])
    return m


def test_sparseness_and_complexity_hand_computed():
    m = _four_cells()
    # Gini: sorted |a| has 1, 1, 2, 4 at ranks 13..16 of n = 16, sum 8:
    # (9 * 1 + 11 * 1 + 13 * 2 + 15 * 4) / (16 * 8) = 106 / 128
    assert M.sparseness(m).item() == pytest.approx(106 / 128)
    # entropy of p = 1/8, 1/8, 1/4, 1/2: 2 * (1/8) ln 8 + (1/4) ln 4 + (1/2) ln 2 = 1.75 ln 2
    assert M.complexity(m).item() == pytest.approx(1.75 * math.log(2))


def test_sparseness_and_complexity_extremes_and_invariants():
    n = 7 * 9
    one_hot = torch.zeros(3, 7, 9)
    one_hot[0, 3, 4] = 5.0
    one_hot[1, 0, 0] = -0.1
    one_hot[2, 6, 8] = 1e6
    assert torch.allclose(M.sparseness(one_hot), torch.full((3,), 1 - 1 / n))  # the maximum
    assert torch.equal(M.complexity(one_hot), torch.zeros(3))
    uniform = torch.full((2, 7, 9), 3.0)
    uniform[1] = -2.0
    assert torch.allclose(M.sparseness(uniform), torch.zeros(2), atol=1e-7)
    assert torch.allclose(M.complexity(uniform), torch.full((2,), math.log(n)))
    zero = torch.zeros(1, 7, 9)  # scored as uniform: it concentrates relevance nowhere
    assert M.sparseness(zero).tolist() == [0.0]
    assert M.complexity(zero).item() == pytest.approx(math.log(n))
    gen = torch.Generator().manual_seed(1)
    maps = torch.randn(6, 7, 9, generator=gen)
    for f in (lambda a: a * 37.0, lambda a: -a, lambda a: a.abs()):  # scale and sign invariant
        assert torch.allclose(M.sparseness(f(maps)), M.sparseness(maps), atol=1e-6)
        assert torch.allclose(M.complexity(f(maps)), M.complexity(maps), atol=1e-6)
    assert bool((M.sparseness(maps) < 1 - 1 / n).all()) and bool((M.complexity(maps) < math.log(n)).all())


def test_concentration_size_upsamples_first():
    m = _four_cells()
    up = M.upsample_maps(m, (16, 16))
    assert torch.equal(M.sparseness(m, size=(16, 16)), M.sparseness(up))
    assert torch.equal(M.complexity(m, size=16), M.complexity(up))


def test_histogram_entropy_hand_computed():
    m = torch.zeros(1, 4, 4)
    m.view(-1)[8:12] = 1.0
    m.view(-1)[12:] = 2.0  # 8 zeros, 4 ones, 4 twos
    # 100 bins over [0, 2]: 0 -> bin 0, 1 -> bin 50, 2 -> the last bin: counts 8, 4, 4
    assert M.histogram_entropy(m).item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(4))
    # 2 bins, edges 0, 1, 2: 1 falls in the second bin with the maximum: counts 8, 8
    assert M.histogram_entropy(m, bins=2).item() == pytest.approx(math.log(2))
    assert M.histogram_entropy(torch.full((2, 3, 3), 4.2)).tolist() == [0.0, 0.0]  # one bin
    with pytest.raises(vx.UsageError, match="bins"):
        M.histogram_entropy(m, bins=0)
