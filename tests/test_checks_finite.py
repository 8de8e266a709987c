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
