"""PerceptionLM (a thumbnail then tiles, a timm Perception Encoder, patches average-pooled 2 x 2): the checks of
tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints), the canvas of a tall image, and the
refusal of a batch whose images are cut into different numbers of tiles."""

import pytest

import vitexplain as vx
import vlm_helpers as helpers
from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import check_footprints, family

built = family(["perception_lm"])


def test_a_tall_image_is_a_thumbnail_then_a_column_of_tiles(built):
    name, model, proc = built
    ex = vx.Explainer(model, processor=proc)
    image = helpers.images(3, ((60, 14),))[0]
    view = ex.adapter.views([image], ex.adapter.prepare([image], ["what is"]))[0]
    # of the canvases of at most 4 tiles of 16 px, only 1 x 4 (16 x 64 px) holds 60 x 14 without downscaling: 4 rows of 15 px
    assert [p.name for p in view.pieces] == ["thumbnail", "tile 0,0", "tile 1,0", "tile 2,0", "tile 3,0"]
    assert [p.box for p in view.pieces[1:3]] == [(0.0, 0.0, 15.0, 14.0), (15.0, 0.0, 30.0, 14.0)]
    check_footprints(built, (60, 14))  # the thumbnail and every tile, by the probe


def test_a_batch_of_images_cut_into_different_numbers_of_tiles_is_refused_with_the_way_out(built):
    name, model, proc = built
    wide, tall = helpers.images(4, ((40, 52), (30, 64)))
    ex = vx.Explainer(model, processor=proc)
    with pytest.raises(vx.InputError, match=r"cut into \[5, 3\] pieces .* separate calls"):
        ex.explain_caption([wide, tall], prompt=["what is", "what is"], max_len=2)
    one = vx.Explainer(model, processor=proc, processor_kwargs={"max_num_tiles": 1})
    e = one.explain_caption([wide, tall], prompt=["what is", "what is"], max_len=2)  # a thumbnail and one tile each
    assert [len(layers) for layers in e.layers] == [2, 2]
    views = one.adapter.views([wide, tall], one.adapter.prepare([wide, tall], ["", ""]))
    assert [[(p.name, p.box) for p in v.pieces] for v in views] == [
        [("thumbnail", (0.0, 0.0, 40.0, 52.0)), ("tile 0,0", (0.0, 0.0, 40.0, 52.0))],
        [("thumbnail", (0.0, 0.0, 30.0, 64.0)), ("tile 0,0", (0.0, 0.0, 30.0, 64.0))]]
