"""Idefics2 (a perceiver resampler per piece: its latents read every patch of their piece; the quadrants and the whole
image, or the whole image alone): the checks of tests/vlm_checks.py (eager oracle through the resampler's attention,
padded batch, greedy answer, footprints of the patches the resampler reads), and the pieces' boxes."""

import pytest

import vitexplain as vx
import vlm_helpers as helpers
from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import check_footprints, family

built = family(["idefics2", "idefics2_whole"])


def test_the_pieces_are_the_quadrants_then_the_whole_image_each_resized_on_its_own(built):
    name, model, proc = built
    ex = vx.Explainer(model, processor=proc)
    image = helpers.images(9, ((30, 70),))[0]
    view = ex.adapter.views([image], ex.adapter.prepare([image], ["what is"]))[0]
    if name == "idefics2_whole":  # 30 x 70 -> 32 x 13 (int(32 / (70 / 30))) -> 16 x 32 (at least 16): 2 x 4 patches
        assert [(p.name, p.grid) for p in view.pieces] == [("image", (2, 4))]
        assert view.pieces[0].box == pytest.approx((0.0, 0.0, 30.0, 70.0))
        return
    # quadrants of 15 x 35 px -> 16 x 35 -> 32 wide: 16 x 32 (int(32 / (35 / 15)) = 13 -> 16); the whole image 16 x 32;
    # all padded to 16 x 32: 2 x 4 patches of 8 px, each quadrant's grid over 15 x 35 of the original
    assert [p.name for p in view.pieces] == ["tile 0,0", "tile 0,1", "tile 1,0", "tile 1,1", "thumbnail"]
    assert view.pieces[3].box == pytest.approx((15.0, 35.0, 30.0, 70.0))
    assert view.pieces[4].box == pytest.approx((0.0, 0.0, 30.0, 70.0))
    assert view.sequence_tokens == 5 * 4 and view.num_tokens == 5 * 8
    check_footprints(built, (70, 30))  # a tall image's quadrants and whole, by the probe
