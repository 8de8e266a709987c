"""PaliGemma, PaliGemma 2 and Gemma 3 (also with pan-and-scan crops): the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['paligemma', 'paligemma2', 'gemma3', 'gemma3_pan_and_scan'])


def test_pan_and_scan_through_processor_kwargs_gives_the_crops_their_own_grids():
    """processor_kwargs reach every processor call: Gemma 3's pan-and-scan, switched on there, gives the same
    maps as a processor that cuts by default, and each crop is a token grid over its own part of the image."""
    import torch

    import vitexplain as vx
    import vlm_helpers as helpers

    model, proc = helpers.gemma3()
    _, cutting = helpers.gemma3_pan_and_scan()
    images = helpers.images(3, ((40, 52), (61, 30)))  # landscape: 2 crops side by side; portrait: 2 stacked
    answers = [[proc.tokenizer.convert_tokens_to_ids(w) for w in words] for words in (["red", "circle"], ["blue", "on"])]
    given = vx.Explainer(model, processor=proc, processor_kwargs=helpers.PAN_AND_SCAN)
    by_default = vx.Explainer(model, processor=cutting)
    a = given.explain_caption(images, prompt="what is", caption=answers, method="cross")
    b = by_default.explain_caption(images, prompt="what is", caption=answers, method="cross")
    for x, y in zip(a.image_maps, b.image_maps):
        torch.testing.assert_close(x, y)
    views = given.adapter.views(images, given.adapter.prepare(images, ["what is"] * 2))
    assert [p.box for p in views[0].pieces[1:]] == [(0, 0, 40, 26), (0, 26, 40, 52)]
    assert [p.box for p in views[1].pieces[1:]] == [(0, 0, 31, 30), (31, 0, 61, 30)]
    plain = vx.Explainer(model, processor=proc).explain_caption(images, prompt="what is", caption=answers, method="cross")
    assert plain.token_scores[0].shape[-1] == 16 and a.token_scores[0].shape[-1] == 48  # the crops' tokens are read


def test_processor_kwargs_need_a_processor():
    import pytest

    import vitexplain as vx
    import vlm_helpers as helpers

    model, _ = helpers.gemma3()
    with pytest.raises(vx.errors.UsageError, match="processor_kwargs= needs processor="):
        vx.Explainer(model, processor_kwargs=helpers.PAN_AND_SCAN)
