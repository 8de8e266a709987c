"""vx.metrics against hand-computed cases and hand-written oracles (fast, CPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import vitexplain as vx
from vitexplain import metrics as M

SIG10 = 1.0 / (1.0 + math.exp(-10.0))


# ------------------------------------------------------------------------------------------------
# pointing game
# ------------------------------------------------------------------------------------------------


def _square_mask(size=64, lo=20, hi=30):
    m = torch.zeros(1, size, size, dtype=torch.bool)
    m[:, lo : hi + 1, lo : hi + 1] = True
    return m


def _pixel_peak(size, r, c):
    m = torch.zeros(1, size, size)
    m[0, r, c] = 1.0
    return m


def test_default_tolerance_scales_with_size():
    assert M.default_tolerance(224) == 15
    assert M.default_tolerance((64, 64)) == 4
    assert M.default_tolerance((128, 100)) == 9  # round(8.57), uses max(H, W)
    assert M.default_tolerance(448) == 30
    assert M.default_tolerance(112) == 8  # 7.5 rounds half up


def test_peak_ties_resolve_to_the_centre_of_the_tied_set():
    # bilinear (align_corners=False) x8: cell (2, 2)'s centre falls between pixels 19 and 20, so a
    # 2x2 block ties; all four are equally close to its centre (19.5, 19.5): the first in row-major order
    grid = torch.zeros(1, 8, 8)
    grid[0, 2, 2] = 1.0
    assert M.peak_locations(grid, (64, 64)).tolist() == [[19, 19]]
    # a peak in the bottom row: rows 60..63 replicate the last cell (border), columns 19..20 tie;
    # the tied set's centre is (61.5, 19.5): (61, 19) is the first of the four closest
    grid = torch.zeros(1, 8, 8)
    grid[0, 7, 2] = 1.0
    assert M.peak_locations(grid, (64, 64)).tolist() == [[61, 19]]
    # a constant map ties everywhere: the centre of the image
    assert M.peak_locations(torch.ones(1, 4, 4), (16, 16)).tolist() == [[7, 7]]
    # two separate equal peaks (2x2 blocks at 11..12 and 51..52): the centroid (31.5, 31.5) lies
    # between them; the closest tied pixels are (12, 12) and (51, 51), equally far: the first wins
    grid = torch.zeros(1, 8, 8)
    grid[0, 1, 1] = grid[0, 6, 6] = 1.0
    assert M.peak_locations(grid, (64, 64)).tolist() == [[12, 12]]
    # values closer than rtol (a fraction of the range) tie; rtol=0 keeps only exact ties
    grid[0, 6, 6] = 1.0 - 1e-6
    assert M.peak_locations(grid, (64, 64)).tolist() == [[12, 12]]
    assert M.peak_locations(grid, (64, 64), rtol=0).tolist() == [[11, 11]]
    grid[0, 1, 1], grid[0, 6, 6] = 1.0 - 1e-6, 1.0
    assert M.peak_locations(grid, (64, 64)).tolist() == [[12, 12]]
    assert M.peak_locations(grid, (64, 64), rtol=0).tolist() == [[51, 51]]
    with pytest.raises(vx.UsageError, match="rtol"):
        M.peak_locations(grid, (64, 64), rtol=-1)


def test_a_constant_map_is_a_miss_wherever_the_object_is():
    everywhere = torch.ones(3, 64, 64, dtype=torch.bool)
    maps = torch.stack([torch.zeros(8, 8), torch.full((8, 8), 3.5), torch.zeros(8, 8)])
    maps[2, 4, 4] = 1e-3  # one cell above the rest: it points
    assert M.pointing_game(maps, everywhere).tolist() == [False, False, True]
    assert M.peak_locations(maps[:1], (64, 64)).tolist() == [[31, 31]]  # the centre of the tied set


def _rescaled(maps):
    """The same maps times several positive constants and through a positive affine map."""
    return [maps * 0.053, maps, maps * 1e3, 0.37 * maps + 5.0]


def test_pointing_game_is_invariant_to_positive_scaling_and_upsampling_ties():
    gen = torch.Generator().manual_seed(0)
    n = 400
    smooth = torch.rand(n, 8, 8, generator=gen)
    quantised = torch.randint(0, 4, (n, 8, 8), generator=gen).float()  # plateaus of equal cells
    signed = torch.randn(n, 8, 8, generator=gen)
    border = torch.rand(n, 8, 8, generator=gen) * 0.5
    border[:, -1] += 0.5  # the peak in the bottom row: 4-pixel replicated plateaus at 8x
    masks = torch.zeros(n, 64, 64, dtype=torch.bool)
    corners = torch.randint(0, 56, (n, 2), generator=gen)
    for i, (r, c) in enumerate(corners.tolist()):
        masks[i, r : r + 9, c : c + 9] = True
    for maps in (smooth, quantised, signed, border):
        peaks = [M.peak_locations(m, (64, 64)) for m in _rescaled(maps)]
        hits = [M.pointing_game(m, masks) for m in _rescaled(maps)]
        for p, h in zip(peaks[1:], hits[1:]):
            assert torch.equal(p, peaks[0])
            assert torch.equal(h, hits[0])
        # the peak is a maximum of the upsampled map (to the tie tolerance)
        up = M.upsample_maps(maps, (64, 64))
        at_peak = up[torch.arange(n), peaks[0][:, 0], peaks[0][:, 1]]
        span = maps.flatten(1).amax(1) - maps.flatten(1).amin(1)
        assert bool((at_peak >= up.flatten(1).amax(1) - 2e-5 * span).all())


def test_pointing_game_reported_tie_case():
    """The reported case: a `generic` map of the bundled shapes-vit (fresh image) whose peak is in the
    bottom row of the grid. Upsampled, rows 60..63 of column 20 are equal but differ by rounding, and
    plain argmax picked (62, 20) (a miss, 5 px below the object) for the map and (60, 20) (a hit) for
    the map x 0.053 or x 7 (torch 2.14.1, CPU)."""
    values = [
        0.00223639188, 0.00248607248, 0.00245913817, 0.002272991, 0.00251393649, 0.00312803197, 0.00389518496,
        0.00422074739, 0.0023862822, 0.00167742302, 0.00274649961, 0.0033054878, 0.0419016145, 0.00239059166,
        0.00329160225, 0.00382877421, 0.00273201661, 0.00321020186, 0.00301652751, 0.0022753377, 0.0155824739,
        0.033659678, 0.00268524769, 0.00399163831, 0.00397694763, 0.00386259682, 0.00399829308, 0.0241699573,
        0.0208129939, 0.0108227264, 0.00431473553, 0.00439505931, 0.00792960916, 0.0147173768, 0.0153145166,
        0.00655040471, 0.00414965209, 0.00392055884, 0.00372915575, 0.00359652052, 0.022559654, 0.0651860237,
        0.572628975, 0.368668467, 0.0152810365, 0.00486962497, 0.00336712319, 0.00401275838, 0.0267128125,
        0.122926161, 0.513690174, 0.800217628, 0.0268959366, 0.0102517214, 0.00454727095, 0.00393897621,
        0.0302402303, 0.0829416513, 0.965118766, 0.291798979, 0.0275976155, 0.0172974113, 0.00502192043,
        0.00333133177,
    ]
    grid = torch.tensor(values).view(1, 8, 8)
    mask = torch.zeros(1, 64, 64, dtype=torch.bool)
    mask[0, 42:58, 15:31] = True  # the object ends at row 57
    up = M.upsample_maps(grid, (64, 64))[0]
    assert torch.allclose(up[60:64, 20], up[60, 20].expand(4), rtol=1e-6, atol=0)  # the tie
    for m in [grid * 7.0, *_rescaled(grid)]:
        # the tied set is rows 60..63 of column 20; its centre (61.5, 20) is closest to rows 61 and 62
        assert M.peak_locations(m, (64, 64)).tolist() == [[61, 20]]
        assert M.pointing_game(m, mask).tolist() == [True]  # 4 px from row 57: within the tolerance


def test_pointing_game_hits_inside_misses_outside():
    mask = _square_mask()
    inside = torch.zeros(1, 8, 8)
    inside[0, 3, 3] = 1.0  # peak at pixel (27, 27)
    outside = torch.zeros(1, 8, 8)
    outside[0, 6, 6] = 1.0  # peak at pixel (51, 51)
    maps = torch.cat([inside, outside])
    masks = mask.expand(2, -1, -1)
    assert M.pointing_game(maps, masks).tolist() == [True, False]
    assert M.pointing_accuracy(maps, masks) == pytest.approx(0.5)
    # numpy inputs work too
    assert M.pointing_game(maps.numpy(), masks.numpy()).tolist() == [True, False]
    assert vx.metrics.pointing_game is M.pointing_game


def test_pointing_game_tolerance():
    mask = _square_mask()  # cols 20..30
    near = _pixel_peak(64, 25, 34)  # 4 px right of the mask: within the default 4 px at 64 px
    far = _pixel_peak(64, 25, 35)  # 5 px
    assert M.pointing_game(near, mask).tolist() == [True]
    assert M.pointing_game(far, mask).tolist() == [False]
    assert M.pointing_game(far, mask, tolerance=5).tolist() == [True]
    assert M.pointing_game(near, mask, tolerance=0).tolist() == [False]
    assert M.pointing_game(_pixel_peak(64, 25, 25), mask, tolerance=0).tolist() == [True]
    # Euclidean disk, not a square: the corner (30, 30) is sqrt(32) = 5.66 px from (34, 34)
    diag = _pixel_peak(64, 34, 34)
    assert M.pointing_game(diag, mask, tolerance=5).tolist() == [False]
    assert M.pointing_game(diag, mask, tolerance=6).tolist() == [True]


def test_pointing_game_tolerance_scales_with_mask_size():
    # 8 px off the object: a miss at 64 px (tolerance 4) but a hit at 128 px (tolerance 9)
    assert M.pointing_game(_pixel_peak(64, 25, 38), _square_mask(64, 20, 30)).tolist() == [False]
    assert M.pointing_game(_pixel_peak(128, 50, 69), _square_mask(128, 40, 61)).tolist() == [True]


def test_pointing_game_union_mask():
    masks = torch.zeros(1, 2, 32, 32, dtype=torch.bool)
    masks[0, 0, :8, :8] = True
    masks[0, 1, 24:, 24:] = True
    peak = _pixel_peak(32, 28, 28)
    assert M.pointing_game(peak, masks[:, 0]).tolist() == [False]
    assert M.pointing_game(peak, masks.any(1)).tolist() == [True]


def test_pointing_game_errors():
    mask = _square_mask()
    with pytest.raises(ValueError, match=r"\(B, h, w\)"):
        M.pointing_game(torch.zeros(8, 8), mask)
    with pytest.raises(ValueError, match=r"\(B, H, W\)"):
        M.pointing_game(torch.zeros(1, 8, 8), mask[0])
    with pytest.raises(ValueError, match="match"):
        M.pointing_game(torch.zeros(2, 8, 8), mask)
    bad = torch.zeros(1, 8, 8)
    bad[0, 1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        M.pointing_game(bad, mask)
    with pytest.raises(ValueError, match="empty"):
        M.pointing_game(torch.zeros(1, 8, 8), torch.zeros(1, 64, 64, dtype=torch.bool))
    with pytest.raises(ValueError, match="tolerance"):
        M.pointing_game(torch.zeros(1, 8, 8), mask, tolerance=-1)


# ------------------------------------------------------------------------------------------------
# relevance mass
# ------------------------------------------------------------------------------------------------


def test_relevance_mass_hand_computed():
    m = torch.tensor([[2.0, 1.0, -3.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 4.0, 0.0], [0.0, 0.0, 0.0, -1.0]])
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[:2, :2] = True
    # inside positive: 2 + 1 + 1 = 4; all positive: 2 + 1 + 1 + 4 = 8 (-3 and -1 ignored)
    out = M.relevance_mass(m[None], mask[None])
    assert out.shape == (1,)
    assert out.item() == pytest.approx(0.5)


def test_relevance_mass_upsamples_map_to_mask():
    # [[1, 0], [0, 0]] bilinearly to 4x4 is outer(w, w), w = [1, .75, .25, 0];
    # top-left quadrant: 1.75^2 = 3.0625 of a total 2^2 = 4
    m = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)
    mask[0, :2, :2] = True
    assert M.relevance_mass(m, mask).item() == pytest.approx(3.0625 / 4)


def test_relevance_mass_no_positive_relevance_is_zero():
    maps = torch.stack([-torch.ones(4, 4), torch.zeros(4, 4), torch.ones(4, 4)])
    mask = torch.zeros(3, 4, 4, dtype=torch.bool)
    mask[:, 0, :] = True
    out = M.relevance_mass(maps, mask)
    assert not torch.isnan(out).any()
    assert out.tolist() == pytest.approx([0.0, 0.0, 0.25])


# ------------------------------------------------------------------------------------------------
# deletion / insertion
# ------------------------------------------------------------------------------------------------


class TopLeft(nn.Module):
    """Logits (s, 0) with s = 10 * mean of the top-left 4x4 patch: softmax p = sigmoid(s)."""

    def forward(self, x):
        s = 10.0 * x[:, :, :4, :4].mean(dim=(1, 2, 3))
        return torch.stack([s, torch.zeros_like(s)], dim=1)


def _perfect():
    m = torch.zeros(1, 4, 4)
    m[0, 0, 0] = 1.0
    return m


def _random_map():
    # a fixed "random" order in which the read patch comes 8th of 16
    vals = torch.randperm(16).float()
    vals[vals == 8] = vals[0].item()
    vals[0] = 8.0
    return (16 - vals).view(1, 4, 4)  # patch 0 has relevance 8 -> rank 8 (0-based: 8th highest)


def test_deletion_insertion_hand_computed_curves():
    model, x = TopLeft().eval(), torch.ones(1, 3, 16, 16)
    d = M.deletion_insertion(model, x, _perfect(), 0, mode="deletion", baseline="zero")
    assert d.curves.shape == (1, 17) and d.fractions.shape == (17,)
    assert d.fractions[0].item() == 0.0 and d.fractions[-1].item() == 1.0
    expected = [SIG10] + [0.5] * 16
    assert d.curves[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert d.auc.item() == pytest.approx((SIG10 + 0.5) / 2 / 16 + 15 * 0.5 / 16, abs=1e-6)
    i = M.deletion_insertion(model, x, _perfect(), 0, mode="insertion", baseline="zero")
    assert i.curves[0].tolist() == pytest.approx([0.5] + [SIG10] * 16, abs=1e-6)
    assert i.auc.item() == pytest.approx((SIG10 + 0.5) / 2 / 16 + 15 * SIG10 / 16, abs=1e-6)
    # fewer steps: counts 0, 4, 8, 12, 16 patches
    d4 = M.deletion_insertion(model, x, _perfect(), 0, baseline="zero", steps=4)
    assert d4.fractions.tolist() == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    assert d4.curves[0].tolist() == pytest.approx([SIG10, 0.5, 0.5, 0.5, 0.5], abs=1e-6)


def test_perfect_map_beats_random_and_inverted():
    model, x = TopLeft().eval(), torch.ones(1, 3, 16, 16)
    maps = {"perfect": _perfect(), "random": _random_map(), "inverted": 1.0 - _perfect()}
    dele = {k: M.deletion_auc(model, x, m, 0, baseline="zero").item() for k, m in maps.items()}
    ins = {k: M.insertion_auc(model, x, m, 0, baseline="zero").item() for k, m in maps.items()}
    assert dele["perfect"] < dele["random"] < dele["inverted"]
    assert ins["perfect"] > ins["random"] > ins["inverted"]
    # inverted: the read patch goes last (stable sort: ties among the other 15 keep row-major order)
    inv = M.deletion_insertion(model, x, maps["inverted"], 0, baseline="zero")
    assert inv.curves[0].tolist() == pytest.approx([SIG10] * 16 + [0.5], abs=1e-6)


def test_deletion_curve_endpoints_are_image_and_baseline():
    torch.manual_seed(1)
    model = _tiny_cnn().eval()
    x = torch.randn(2, 3, 16, 16)
    maps = torch.rand(2, 4, 4)
    base = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        p_img = torch.softmax(model(x), 1)[:, 1]
        p_base = torch.softmax(model(base.expand_as(x)), 1)[:, 1]
    d = M.deletion_insertion(model, x, maps, 1, baseline=base)
    assert torch.allclose(d.curves[:, 0], p_img, atol=1e-6)
    assert torch.allclose(d.curves[:, -1], p_base, atol=1e-6)
    i = M.deletion_insertion(model, x, maps, 1, mode="insertion", baseline=lambda im: base.expand_as(im))
    assert torch.allclose(i.curves[:, 0], p_base, atol=1e-6)
    assert torch.allclose(i.curves[:, -1], p_img, atol=1e-6)


def test_target_none_is_predicted_class_and_scores():
    model, x = TopLeft().eval(), torch.ones(2, 3, 16, 16)
    d = M.deletion_insertion(model, x, _perfect().expand(2, -1, -1), None, baseline="zero", steps=2)
    assert d.targets.tolist() == [0, 0]
    # sigmoid of logit s equals softmax over (s, 0); raw logits through a callable
    s = M.deletion_insertion(model, x, _perfect().expand(2, -1, -1), 0, baseline="zero", score="sigmoid", steps=2)
    assert torch.allclose(s.curves, d.curves, atol=1e-6)
    raw = M.deletion_insertion(
        model, x, _perfect().expand(2, -1, -1), [0, 1], baseline="zero", score=lambda z: z, steps=2
    )
    assert raw.curves.flatten().tolist() == pytest.approx([10.0, 0.0, 0.0, 0.0, 0.0, 0.0], abs=1e-5)


def test_patch_size_reduces_pixel_map():
    model, x = TopLeft().eval(), torch.ones(1, 3, 16, 16)
    pix = torch.zeros(1, 16, 16)
    pix[0, :4, :4] = 1.0
    a = M.deletion_insertion(model, x, pix, 0, baseline="zero", patch=4)
    b = M.deletion_insertion(model, x, _perfect(), 0, baseline="zero")
    assert torch.allclose(a.curves, b.curves)


def test_blur_baseline_keeps_constant_image():
    model, x = TopLeft().eval(), torch.ones(1, 3, 16, 16)
    d = M.deletion_insertion(model, x, _perfect(), 0, baseline="blur", steps=4)
    assert d.curves[0].tolist() == pytest.approx([SIG10] * 5, abs=1e-5)


def _tiny_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


@pytest.mark.parametrize("baseline", ["blur", "mean", "zero"])
def test_deletion_batch_of_4_equals_4_batches_of_1(baseline):
    model = _tiny_cnn().eval()
    x = torch.randn(4, 3, 16, 16)
    maps = torch.rand(4, 4, 4)
    maps[1] = 0.0  # all ties: row-major order
    target = [0, 1, 2, 1]
    for mode in ("deletion", "insertion"):
        full = M.deletion_insertion(model, x, maps, target, mode=mode, baseline=baseline, batch_size=7)
        for i in range(4):
            one = M.deletion_insertion(
                model, x[i : i + 1], maps[i : i + 1], target[i], mode=mode, baseline=baseline, batch_size=5
            )
            assert torch.allclose(full.curves[i], one.curves[0], atol=1e-6)
            assert torch.allclose(full.auc[i], one.auc[0], atol=1e-6)


def test_deletion_errors_and_training_warning():
    model, x = TopLeft().eval(), torch.ones(1, 3, 16, 16)
    with pytest.raises(ValueError, match="mode"):
        M.deletion_insertion(model, x, _perfect(), 0, mode="both")
    with pytest.raises(ValueError, match="steps"):
        M.deletion_insertion(model, x, _perfect(), 0, steps=17)
    with pytest.raises(ValueError, match=r"\(1, h, w\)"):
        M.deletion_insertion(model, x, torch.zeros(2, 4, 4), 0)
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        M.deletion_insertion(model, x[0], _perfect(), 0)
    with pytest.raises(ValueError, match="baseline"):
        M.deletion_insertion(model, x, _perfect(), 0, baseline="noise")
    with pytest.raises(vx.TargetError, match="out of range"):
        M.deletion_insertion(model, x, _perfect(), 5, baseline="zero", steps=1)
    with pytest.warns(UserWarning, match="training mode"):
        M.deletion_insertion(TopLeft(), x, _perfect(), 0, baseline="zero", steps=1)


# ------------------------------------------------------------------------------------------------
# rank correlation and class sensitivity
# ------------------------------------------------------------------------------------------------


def _oracle_ranks(v):
    """1-based average ranks, by counting (O(n^2), obviously right)."""
    return [sum(u < x for u in v) + (sum(u == x for u in v) + 1) / 2 for x in v]


def _oracle_pearson(x, y):
    mx, my = sum(x) / len(x), sum(y) / len(y)
    num = sum((a - mx) * (b - my) for a, b in zip(x, y))
    den = math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))
    return num / den


def test_rank_correlation_hand_computed():
    a = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    b = torch.tensor([[[1.0, 3.0], [2.0, 4.0]]])
    assert M.rank_correlation(a, b).item() == pytest.approx(0.8)  # 1 - 6 * 2 / (4 * 15)
    # ties: ranks (1.5, 1.5, 3, 4) and (1.5, 3, 1.5, 4) -> 2.25 / 4.5
    a = torch.tensor([[[0.0, 0.0], [1.0, 2.0]]])
    b = torch.tensor([[[0.0, 1.0], [0.0, 2.0]]])
    assert M.rank_correlation(a, b).item() == pytest.approx(0.5)


def test_rank_correlation_matches_oracle_with_many_ties():
    a = torch.relu(torch.randn(5, 6, 7)).mul(2).round()  # ReLU-clamped: many zeros and ties
    b = torch.relu(torch.randn(5, 6, 7) + 0.5 * a).mul(2).round()
    got = M.rank_correlation(a, b)
    assert got.shape == (5,)
    for i in range(5):
        x, y = a[i].flatten().tolist(), b[i].flatten().tolist()
        assert got[i].item() == pytest.approx(_oracle_pearson(_oracle_ranks(x), _oracle_ranks(y)), abs=1e-6)
    # invariant to a monotone transform; batch of 5 == 5 batches of 1
    assert torch.allclose(M.rank_correlation(a.exp(), b * 3 + 1), got, atol=1e-6)
    for i in range(5):
        assert torch.allclose(M.rank_correlation(a[i : i + 1], b[i : i + 1]), got[i : i + 1])


def test_rank_correlation_matches_scipy():
    stats = pytest.importorskip("scipy.stats")  # in the test extra: runs in CI
    a = torch.relu(torch.randn(3, 10, 10)).round()
    b = torch.relu(torch.randn(3, 10, 10)).round()
    got = M.rank_correlation(a, b)
    for i in range(3):
        ref = stats.spearmanr(a[i].flatten().numpy(), b[i].flatten().numpy())[0]
        assert got[i].item() == pytest.approx(ref, abs=1e-6)


def test_constant_maps_give_zero_or_nan():
    a = torch.zeros(2, 3, 3)
    b = torch.randn(2, 3, 3)
    assert M.rank_correlation(a, b).tolist() == [0.0, 0.0]
    assert M.rank_correlation(a, a).tolist() == [0.0, 0.0]
    assert torch.isnan(M.rank_correlation(a, b, constant_value=float("nan"))).all()
    assert M.class_sensitivity(a, b).tolist() == [0.0, 0.0]


def test_correlation_errors():
    with pytest.raises(ValueError, match="same shape"):
        M.rank_correlation(torch.zeros(2, 3, 3), torch.zeros(2, 4, 4))
    bad = torch.zeros(1, 3, 3)
    bad[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        M.rank_correlation(bad, torch.zeros(1, 3, 3))


def test_class_sensitivity_identical_and_negated():
    a = torch.randn(3, 5, 5)
    assert M.class_sensitivity(a, a).tolist() == pytest.approx([1.0] * 3, abs=1e-6)
    assert M.class_sensitivity(a, -a).tolist() == pytest.approx([-1.0] * 3, abs=1e-6)
    assert M.class_sensitivity(a, 2 * a + 3).tolist() == pytest.approx([1.0] * 3, abs=1e-6)
    assert M.class_sensitivity(a, -a, method="spearman").tolist() == pytest.approx([-1.0] * 3, abs=1e-6)
    assert M.class_sensitivity(a.numpy(), np.asarray(a)).tolist() == pytest.approx([1.0] * 3, abs=1e-6)
    x, y = a[0].flatten().tolist(), torch.randn(25).tolist()
    got = M.class_sensitivity(a[:1], torch.tensor(y).view(1, 5, 5)).item()
    assert got == pytest.approx(_oracle_pearson(x, y), abs=1e-6)
    with pytest.raises(ValueError, match="method"):
        M.class_sensitivity(a, a, method="kendall")


# ------------------------------------------------------------------------------------------------
# randomisation check
# ------------------------------------------------------------------------------------------------


def _grad_x_input(x, target=0):
    def explain(model):
        xi = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(model(xi)[:, target].sum(), xi)
        return (g * xi).sum(1)

    return explain


def test_randomization_check_correlation_drops_and_model_untouched():
    model = _tiny_cnn()
    x = torch.randn(3, 3, 12, 12)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    res = M.randomization_check(model, _grad_x_input(x), seed=0, return_maps=True)
    assert res.layers == ["6", "2", "0"]  # parameterised children, output side first
    assert res.correlations.shape == (3, 3)
    assert res.maps is not None and res.maps.shape == (3, 3, 12, 12)
    assert torch.allclose(res.reference, _grad_x_input(x)(model))
    # fully randomised, the maps no longer agree: over 100 seeds of this model and input, the mean
    # over the 3 images is 0.001 with sd 0.164 (seed 0: -0.138); ceiling = mean + 3 sd, rounded up
    assert res.correlations[-1].mean() < 0.50
    assert (res.correlations < 0.999).all()
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.training  # training flag left as found
    assert torch.equal(torch.random.get_rng_state(), rng)  # global RNG untouched
    again = M.randomization_check(model, _grad_x_input(x), seed=0)
    assert torch.equal(again.correlations, res.correlations)  # seeded
    other = M.randomization_check(model, _grad_x_input(x), seed=1)
    assert not torch.equal(other.correlations, res.correlations)


def test_randomization_check_explicit_layers_and_independent():
    model = _tiny_cnn().eval()
    x = torch.randn(2, 3, 12, 12)
    res = M.randomization_check(model, _grad_x_input(x), layers=["2", "0"], mode="independent", absolute=True)
    assert res.layers == ["2", "0"] and res.correlations.shape == (2, 2)
    assert torch.isfinite(res.correlations).all()
    with pytest.raises(ValueError, match="unknown layer"):
        M.randomization_check(model, _grad_x_input(x), layers=["head"])
    with pytest.raises(ValueError, match=r"\(B, h, w\)"):
        M.randomization_check(model, lambda m: torch.zeros(4, 4))


def test_randomization_layers_expands_containers():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 1)
            self.act = nn.ReLU()
            self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            self.head = nn.Linear(4, 2)

    assert M.randomization_layers(Net()) == ["head", "blocks.1", "blocks.0", "stem"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_metrics_run_on_cuda():
    dev = torch.device("cuda")
    maps = torch.rand(2, 4, 4, device=dev)
    masks = torch.zeros(2, 16, 16, dtype=torch.bool, device=dev)
    masks[:, :8, :8] = True
    assert M.pointing_game(maps, masks).device.type == "cuda"
    assert M.relevance_mass(maps, masks).device.type == "cuda"
    assert torch.allclose(M.rank_correlation(maps, maps * 2).cpu(), torch.ones(2))
    model = _tiny_cnn().to(dev).eval()
    x = torch.randn(2, 3, 16, 16, device=dev)
    res = M.deletion_insertion(model, x, maps, [0, 1], baseline="blur")
    cpu = M.deletion_insertion(model.cpu(), x.cpu(), maps.cpu(), [0, 1], baseline="blur")
    assert torch.allclose(res.curves.cpu(), cpu.curves, atol=1e-4)
    model.to(dev)
    rc = M.randomization_check(model, _grad_x_input(x))
    assert rc.correlations.shape == (3, 2) and next(model.parameters()).device.type == "cuda"
