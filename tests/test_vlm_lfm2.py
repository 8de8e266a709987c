"""LFM2-VL (SigLIP2 NaFlex tower, pixel unshuffle, tiles plus a thumbnail; an LM of convolution and attention layers):
the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints) for cross and cross_grad, and
cross_generic refused with the reason."""

import pytest

import vitexplain as vx
import vlm_helpers as helpers
from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import check_footprints, family

built = family(["lfm2_vl"])


def test_a_small_image_is_one_grid_and_a_large_one_tiles_plus_a_thumbnail(built):
    name, model, proc = built
    ex = vx.Explainer(model, processor=proc)
    small, tall = helpers.images(3, ((30, 30), (90, 34)))
    views = ex.adapter.views([small, tall], ex.adapter.prepare([small, tall], ["", ""]))
    assert [p.name for p in views[0].pieces] == ["image"]
    assert [p.name for p in views[1].pieces] == ["tile 0,0", "tile 1,0", "tile 2,0", "thumbnail"]
    check_footprints(built, (90, 34))  # every tile and the thumbnail, by the probe


def test_chefers_rules_are_refused_for_the_convolution_layers(built):
    name, model, proc = built
    ex = vx.Explainer(model, processor=proc)
    assert ex.methods() == ["cross", "cross_grad"]
    with pytest.raises(vx.UnsupportedMethodError, match=r"2 of the 4 language-model layers .* short convolutions"):
        ex.explain_caption(helpers.images(1)[:1], method="cross_generic", prompt="what is")
