"""MiniCPM-V 4.6 and 4.7 (the source image, then slices; patches merged 4 x 4, or 2 x 2 in "4x" mode; an LM of linear-attention
and attention layers): the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints) for
cross and cross_grad in both modes, the slices of a wide image, and the refusals (cross_generic; a processor merging
otherwise than the model; a processor leaving out what the model needs). 4.7 adds canvas M-RoPE positions, which
the model computes from mm_token_type_ids (required)."""

import pytest

import vitexplain as vx
import vlm_helpers as helpers
from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import check_footprints, family

built = family(["minicpmv4_6", "minicpmv4_6_4x", "minicpmv4_7"])


def test_a_wide_image_is_the_source_then_its_slices(built):
    name, model, proc = built
    ex = vx.Explainer(model, processor=proc)
    image = helpers.images(8, ((30, 80),))[0]
    view = ex.adapter.views([image], ex.adapter.prepare([image], ["what is"]))[0]
    # 30 x 80 px is 2.3 times 32 x 32 px: 2 to 4 slices around ceil(2.3) = 3; a row of 3 (log 3 / 1 is the nearest to
    # log(80 / 30)) of 30 x 26.7 px each
    assert [p.name for p in view.pieces] == ["thumbnail", "tile 0,0", "tile 0,1", "tile 0,2"]
    assert view.pieces[2].box == pytest.approx((0.0, 80 / 3, 30.0, 160 / 3))
    check_footprints(built, (30, 80))  # the source piece and every slice, by the probe


def test_cross_generic_and_a_processor_merging_otherwise_are_refused_with_the_reason(built):
    name, model, proc = built
    ex = vx.Explainer(model, processor=proc)
    assert ex.methods() == ["cross", "cross_grad"]
    with pytest.raises(vx.UnsupportedMethodError, match=r"2 of the 4 language-model layers .* linear attention"):
        ex.explain_caption(helpers.images(1)[:1], method="cross_generic", prompt="what is")
    other = "16x" if name.endswith("_4x") else "4x"
    mixed = vx.Explainer(model, processor=proc, processor_kwargs={"downsample_mode": other})
    with pytest.raises(vx.UnsupportedModelError, match=rf"downsample_mode='{other}'.* processor_kwargs"):
        mixed.explain_caption(helpers.images(1)[:1], prompt="what is")


def test_a_processor_without_the_pieces_patch_grids_is_refused_with_what_to_do(built):
    name, model, proc = built

    class Dropping:  # the model's processor, its output without one key
        def __init__(self, key):
            self.key = key

        def __getattr__(self, attribute):
            return getattr(proc, attribute)

        def __call__(self, *args, **kwargs):
            out = proc(*args, **kwargs)
            del out[self.key]
            return out

    with pytest.raises(vx.UnsupportedModelError, match=r"no target_sizes, which MiniCPMV4_[67]ForConditionalGeneration needs"):
        vx.Explainer(model, processor=Dropping("target_sizes")).explain_caption(helpers.images(1)[:1], prompt="what is")
    if name == "minicpmv4_7":  # its canvas positions: without them generate would silently use 1-D positions
        with pytest.raises(vx.UnsupportedModelError, match="no mm_token_type_ids"):
            vx.Explainer(model, processor=Dropping("mm_token_type_ids")).explain_caption(helpers.images(1)[:1],
                                                                                        prompt="what is")
