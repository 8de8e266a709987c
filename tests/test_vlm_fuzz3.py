"""Vision-language explanations on inputs the family checks do not use (tests/vlm_checks.py's oracles and
invariants): processors whose second tokenizer pads on the left, ... (each case a bug found by fuzzing)."""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
import vlm_checks as checks
import vlm_helpers as helpers


def _noisy(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The model with its matrices moved by N(0, 0.02^2) noise (another random model of the same family)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    return model


def test_instructblip_qformer_text_padded_on_the_left_still_equals_each_image_alone():
    """InstructBLIP's Q-Former reads the prompt with learned absolute positions (0, 1, ... from the first
    column, padding included): a batch must pad its Q-Former text on the right whatever side its tokenizer
    says, or a shorter prompt's Q-Former tokens sit at shifted positions and its map differs from the
    image alone (silently: was off by up to 5% of the map's maximum)."""
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS["instructblip"]()
    _noisy(model, 7)
    proc.qformer_tokenizer.padding_side = "left"  # as a tokenizer saved with left padding loads
    images = helpers.images(17)
    answers = checks._answer_ids(proc, checks.ANSWERS)
    ex = vx.Explainer(model, processor=proc)
    together = ex.explain_caption(images, method=["cross", "cross_grad"], prompt=checks.PROMPTS, caption=answers)
    assert proc.qformer_tokenizer.padding_side == "left"  # the user's processor left as found
    for b, image in enumerate(images):
        alone = ex.explain_caption([image], method=["cross", "cross_grad"], prompt=checks.PROMPTS[b], caption=[answers[b]])
        for e_all, e_one in zip(together, alone):
            n = len(answers[b])
            torch.testing.assert_close(e_all.token_scores[b][:n], e_one.token_scores[0][:n], atol=1e-6, rtol=1e-4)
            torch.testing.assert_close(e_all.image_maps[b][:n], e_one.image_maps[0][:n], atol=1e-6, rtol=1e-4)


def test_idefics2_a_quadrant_padded_past_its_edge_keeps_its_scores_inside_the_quadrant():
    """Idefics2 pads each quadrant to the batch's largest piece; a 36 x 20 image's 18-row quadrants resize to 18 rows,
    so the third patch row holds 2 real rows and 6 of padding, and the vision tower keeps it. Its score must stay on the
    quadrant's own pixels: the original pixels under its padding belong to the lower quadrants, and perturbing them does
    not change it (footprint probe, vision attention off). Was: rendered over 6 rows of the lower quadrants (silent)."""
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS["idefics2"]()
    image = helpers.images(6, ((36, 20),))[0]
    adapter = vx.Explainer(model, processor=proc).adapter
    view = adapter.views([image], adapter.prepare([image], [""]))[0]
    n = view.num_tokens
    _, layers = vx.adapters.vlm.render(torch.arange(1, n + 1, dtype=torch.float64)[None], view)
    probe, features = helpers.isolated_tokens(model), helpers.ORACLE["idefics2"]["features"]
    base = features(probe, proc, image)
    first = view.pieces[0]  # tile 0,0: rows 0..18, columns 0..10 of the original
    assert first.name == "tile 0,0"
    for (y, x), inside in (((17, 4), True), ((21, 4), False)):
        bumped = image.copy()
        bumped[y, x] = 255 - bumped[y, x]
        change = (features(probe, proc, bumped) - base).abs().sum(-1)[first.start : first.start + first.num_tokens]
        token = int(layers[0][0, y, x])  # the tile 0,0 token the geometry puts at (y, x), 1-based; 0: none
        if inside:  # the partly padded row's token holds this pixel
            assert token - 1 - first.start == int(change.argmax()) and float(change.max()) > 1e-3
        else:  # no tile 0,0 token reads this pixel, and the geometry puts none there
            assert float(change.max()) < 1e-6
            assert token == 0, f"tile 0,0's token {token - 1} rendered over pixel {(y, x)} of the lower quadrant"
    explained = vx.Explainer(model, processor=proc).explain_caption([image], method="cross", prompt="what is",
                                                                    caption=[checks._answer_ids(proc, checks.ANSWERS)[0]])
    assert explained.image_maps[0].shape == (4, 36, 20)


def test_idefics2_explorer_page_clips_a_quadrant_to_its_part_of_the_image():
    """The explorer draws each piece's grid over its box; a padded quadrant's box reaches into the next quadrant, so
    the page carries the quadrant's own part (as fractions of the image) and the viewer clips the grid to it."""
    from vitexplain.explorer.vlm import vlm_data

    torch.manual_seed(0)
    model, proc = helpers.BUILDERS["idefics2"]()
    image = helpers.images(6, ((36, 20),))[0]
    ex = vx.Explainer(model, processor=proc)
    data = vlm_data(ex, ex.plan(), image, prompt="what is", max_len=2, attention_budget=1 << 20, notes=[])
    first = data["vlm"]["pieces"][0]
    assert first["name"] == "tile 0,0" and first["box"][2] > 18 / 36  # the grid's box: past the quadrant
    assert first["extent"] == [0.0, 0.0, 18 / 36, 10 / 20]  # rows 0..18, columns 0..10 of 36 x 20
