"""Perturbation metrics never return a silent NaN: a model whose logits are not finite, or a
score function that returns NaN, is a NumericalError naming which of the two is at fault."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vitexplain import metrics
from vitexplain.errors import NumericalError


class _Linear(nn.Module):
    """A tiny classifier; ``poison`` makes its logits NaN for inputs whose mean is below it."""

    def __init__(self, poison: float = -float("inf")) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3 * 16 * 16, 4)
        self.poison = poison

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(x.flatten(1))
        bad = x.flatten(1).mean(1) < self.poison
        return torch.where(bad[:, None], torch.full_like(z, float("nan")), z)


_X = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)) + 1.0  # image means about 1
_MAPS = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(1))


def test_finite_model_scores_as_before():
    model = _Linear().eval()
    r = metrics.deletion_insertion(model, _X, _MAPS, baseline="zero", steps=4)
    assert torch.isfinite(r.curves).all()


@pytest.mark.parametrize("metric", ["deletion", "insertion", "road"])
def test_nan_logits_on_perturbed_inputs_are_an_error(metric):
    model = _Linear(poison=0.5).eval()  # the unmodified images score; the zero baseline (mean 0) gives NaN
    with pytest.raises(NumericalError, match="logits are NaN or inf"):
        if metric == "road":
            metrics.road(model, _X * 0 + float(0.4), _MAPS)  # every input below the poison level
        else:
            metrics.deletion_insertion(model, _X, _MAPS, mode=metric, baseline="zero", steps=4)


def test_a_score_function_returning_nan_is_an_error():
    model = _Linear().eval()
    with pytest.raises(NumericalError, match="score function"):
        metrics.deletion_auc(model, _X, _MAPS, score=lambda z: torch.sqrt(-1.0 - z.abs()))  # NaN everywhere


class _Confident(nn.Module):
    """Logits (N, 3): class 0 about 0, class 1 at -1000 (probability 0 in float32), class 2 about 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.flatten(1).mean(1)
        return torch.stack([m, torch.full_like(m, -1000.0), 1.0 + m], 1)


@pytest.mark.parametrize("metric", ["deletion", "road"])
def test_minus_inf_scores_of_other_classes_are_not_an_error(metric):
    score = lambda z: torch.log_softmax(z, -1).exp().log()  # noqa: E731 - log(0) = -inf for class 1 only
    model = _Confident().eval()
    if metric == "road":
        r = metrics.road(model, _X, _MAPS, target=2, score=score)
    else:
        r = metrics.deletion_insertion(model, _X, _MAPS, target=2, baseline="zero", steps=4, score=score)
    assert torch.isfinite(r.curves).all()
    with torch.no_grad():  # the curve's first point (nothing removed) is the target's own log-probability
        want = torch.log_softmax(model(_X), -1)[:, 2]
    if metric == "deletion":
        torch.testing.assert_close(r.curves[:, 0], want)


def test_pointing_game_takes_a_numpy_tolerance_as_the_same_number():
    import numpy as np

    maps = torch.zeros(2, 8, 8)
    maps[:, 2, 2] = 1.0  # peak near pixel (20, 20) of an 64x64 mask (cell 2 spans 16..23)
    masks = torch.zeros(2, 64, 64, dtype=torch.bool)
    masks[:, 20, 26] = True  # 6 px right of the peak's neighbourhood
    for tol in (3, 8):
        want = metrics.pointing_game(maps, masks, tolerance=tol)
        assert torch.equal(metrics.pointing_game(maps, masks, tolerance=np.int64(tol)), want)
        assert torch.equal(metrics.pointing_game(maps, masks, tolerance=np.float32(tol)), want)
    assert not metrics.pointing_game(maps, masks, tolerance=3).any() and metrics.pointing_game(maps, masks, tolerance=8).all()
    with pytest.raises(Exception, match="tolerance"):
        metrics.pointing_game(maps, masks, tolerance=True)
