"""Molmo2 (a low-resolution view, then overlapping crops stitched into one canvas grid; patches attention-pooled 2 x 2,
the grids padded to whole blocks; one bidirectional image block): the checks of tests/vlm_checks.py (eager oracle,
padded batch, greedy answer, footprints), and the two grids' boxes of a wide image."""

import pytest

import vitexplain as vx
import vlm_helpers as helpers
from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import check_footprints, family

built = family(["molmo2"])


def test_the_low_resolution_grid_and_the_canvas_grid_reach_past_the_image_by_their_pooling_padding(built):
    name, model, proc = built
    ex = vx.Explainer(model, processor=proc)
    image = helpers.images(5, ((30, 70),))[0]
    view = ex.adapter.views([image], ex.adapter.prepare([image], ["what is"]))[0]
    low, high = view.pieces
    # low resolution: 56 px = 7 patches of 8 px a side, pooled 2 x 2 -> 4 x 4 tokens over 8 patches (64 px, the padding
    # after): 64 / 56 of the image's height and width
    assert (low.name, low.grid, low.start) == ("thumbnail", (4, 4), 0)
    assert low.box == pytest.approx((0.0, 0.0, 30 * 64 / 56, 70 * 64 / 56))
    # canvas: windows of 56 - 2 * 8 = 40 px plus 16 px of margins; of the tilings of at most 4 crops, 1 x 2 (40 x 80 px
    # of windows) holds the 14 x 54 px left after the margins with the least upscaling (the first of a tie with 2 x 2)
    # -> 56 x 96 px = 7 x 12 patches -> 4 x 6 tokens, the rows padded by one patch after
    assert (high.name, high.grid, high.start) == ("image", (4, 6), 16)
    assert high.box == pytest.approx((0.0, 0.0, 30 * 64 / 56, 70.0))
    check_footprints(built, (30, 70))  # both grids, by the probe


class _Dropping:
    """The model's processor, its output without ``key`` (a processor that does not give what the model needs)."""

    def __init__(self, processor, key):
        self.processor, self.key = processor, key

    def __getattr__(self, name):
        return getattr(self.processor, name)

    def __call__(self, *args, **kwargs):
        out = self.processor(*args, **kwargs)
        del out[self.key]
        return out


def test_a_processor_without_the_image_token_types_is_refused_with_what_to_do(built):
    name, model, proc = built
    ex = vx.Explainer(model, processor=_Dropping(proc, "mm_token_type_ids"))
    with pytest.raises(vx.UnsupportedModelError, match="no mm_token_type_ids, which Molmo2ForConditionalGeneration needs"):
        ex.explain_caption(helpers.images(1)[:1], prompt="what is")
