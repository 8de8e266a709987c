"""Janus / Janus-Pro and DeepSeek-VL (the image letterboxed into a square, one token per patch): the checks of tests/vlm_checks.py
(eager oracle, padded batch, greedy answer, footprints), and the padding bands of a tall image."""

import torch

import vitexplain as vx
import vlm_helpers as helpers
from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import check_footprints, family

built = family(["janus", "deepseek_vl"])


def test_a_tall_image_is_centred_between_padding_columns(built):
    name, model, proc = built
    check_footprints(built, (90, 34))  # the token columns over the image, by the probe
    # a 90 x 34 image becomes 32 x 12 px (34 * 32 / 90 = 12.09, rounded), centred in 32 px: 10 px of padding either
    # side, so the 4 x 4 grid of 8 px cells spans 90 / 32 * [-10, 22] original columns
    ex = vx.Explainer(model, processor=proc)
    image = helpers.images(7, ((90, 34),))[0]
    view = ex.adapter.views([image], ex.adapter.prepare([image], ["what is"]))[0]
    box = view.pieces[0].box
    torch.testing.assert_close(torch.tensor(box), torch.tensor((0.0, -10 * 34 / 12, 90.0, 22 * 34 / 12)), rtol=0, atol=1e-9)
    # in 8 px cells, token columns 0 and 3 hold padding only; column 1 covers the image's resized columns [10, 16),
    # original [0, 6 * 34 / 12 = 17) (pixel centres 0.5 .. 16.5); column 2 the rest; token row 0 original rows
    # [0, 90 / 4 = 22.5) (centres 0.5 .. 21.5)
    footprints = vx.adapters.vlm.render(torch.eye(16, dtype=torch.float64), view)[0]  # (token, H, W)
    assert footprints.sum((1, 2)).reshape(4, 4)[:, [0, 3]].eq(0).all()
    covered = footprints[1].nonzero()
    assert covered[:, 0].unique().tolist() == list(range(22)) and covered[:, 1].unique().tolist() == list(range(17))
    torch.testing.assert_close(footprints.sum(0), torch.ones(90, 34, dtype=torch.float64))  # each pixel in one token
