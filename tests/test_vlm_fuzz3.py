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
