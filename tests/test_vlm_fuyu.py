"""Fuyu (no vision tower: each patch projected straight into the language model, a newline token after each row): the
checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints), and the grid of a large image
shrunk to fit."""

import pytest

import vitexplain as vx
import vlm_helpers as helpers
from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import check_footprints, family

built = family(["fuyu"])


def test_a_large_image_is_shrunk_to_fit_and_its_last_patches_reach_into_the_padding(built):
    name, model, proc = built
    ex = vx.Explainer(model, processor=proc)
    image = helpers.images(10, ((100, 90),))[0]
    view = ex.adapter.views([image], ex.adapter.prepare([image], ["what is"]))[0]
    # 100 x 90 into 48 x 64: scale 0.48 -> 48 x 43 px; 8 px patches: 6 rows, 6 columns (the last 5 px of image, 3 of
    # padding), so the grid reaches 48 / 0.48 = 48 * 100 / 48 rows and 48 * 90 / 43 columns of the original
    assert view.pieces[0].grid == (6, 6)
    assert view.pieces[0].box == pytest.approx((0.0, 0.0, 100.0, 48 * 90 / 43))
    check_footprints(built, (100, 90))
    with pytest.raises(vx.InputError, match="puts in front of every prompt"):
        ex.explain_caption([image], prompt="|SPEAKER| what is")


def test_a_bfloat16_fuyu_is_explained():
    """Fuyu in bfloat16: the processor's float32 patches reached its bfloat16 patch projection (vision_embed_tokens,
    no vision tower to cast them) and a bare RuntimeError (Float and BFloat16) came out. The patches now take the
    projection's dtype: the maps equal the float32 model's up to bfloat16 rounding (measured over 4 seeds: cross <= 0.9%,
    cross_generic <= 1.9% of the largest value; bounds about 3x that) and the model keeps its dtype."""
    import copy

    import torch

    model, proc = helpers.BUILDERS["fuyu"]()
    images = helpers.images(22, ((40, 60), (50, 30)))
    kwargs = dict(method=["cross", "cross_generic"], prompt="what is", caption="red circle")
    want = vx.Explainer(model, processor=proc).explain_caption(images, **kwargs)
    half = copy.deepcopy(model).to(torch.bfloat16)
    got = vx.Explainer(half, processor=proc).explain_caption(images, **kwargs)
    for e_got, e_want, tol in zip(got, want, (0.03, 0.06)):
        for a, b in zip(e_got.image_maps, e_want.image_maps):
            assert float((a - b).abs().max()) <= tol * float(b.abs().max())
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
