"""The finiteness checks of inputs, target scores and maps: their one-reduction fast path (a finite sum proves every
value finite) must neither let a NaN/inf through nor refuse finite values whose sum overflows."""

from __future__ import annotations

import pytest
import torch

from vitexplain.checks import check_batch, check_finite_maps, check_finite_scores
from vitexplain.errors import InputError, NumericalError

BIG = {torch.float32: 3e38, torch.float16: 6e4, torch.float64: 1.7e308}


@pytest.mark.parametrize("dtype", list(BIG))
def test_finite_values_whose_sum_overflows_pass_every_check(dtype):
    x = torch.full((2, 3, 4, 4), BIG[dtype], dtype=dtype)
    assert torch.isinf(x.sum())  # (the sum alone would have refused them)
    check_batch(x)
    check_finite_scores(x[:, 0, 0, 0])
    maps = x[:, 0]
    assert check_finite_maps(maps, "m") is maps


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_non_finite_value_is_refused_naming_its_image(bad, dtype):
    x = torch.zeros(3, 3, 4, 4, dtype=dtype)
    x[1, 2, 3, 0] = bad
    with pytest.raises(InputError, match=r"images \[1\]"):
        check_batch(x)
    with pytest.raises(NumericalError, match=r"images \[1\]"):
        check_finite_maps(x[:, 2], "m")
    with pytest.raises(NumericalError, match=r"images \[1\]"):
        check_finite_scores(x[:, 2, 3, 0])


def test_inf_and_minus_inf_in_two_images_are_both_named():
    maps = torch.zeros(4, 2, 2)
    maps[0, 0, 0], maps[3, 1, 1] = float("inf"), -float("inf")
    with pytest.raises(NumericalError, match=r"images \[0, 3\]"):
        check_finite_maps(maps, "m")
    with pytest.raises(NumericalError, match=r"images \[0, 3\]"):
        check_finite_scores(maps[:, :, :].flatten(1).sum(dim=1))


def test_input_channels_reads_the_preprocessing_settings_only_when_the_model_does_not_say():
    from torch import nn

    from vitexplain.checks import input_channels

    def never():
        raise AssertionError("the settings were read although the model says its channels")

    declared = nn.Linear(2, 2)
    declared.in_chans = 4
    assert input_channels(declared, never) == 4
    assert input_channels(nn.Sequential(nn.Conv2d(5, 2, 1)), never) == 5
    calls = []
    assert input_channels(nn.Linear(2, 2), lambda: calls.append(1) or {"mean": (0.5,)}) == 1
    assert calls == [1]
    assert input_channels(nn.Linear(2, 2), {"mean": (0.5, 0.5)}) == 2
