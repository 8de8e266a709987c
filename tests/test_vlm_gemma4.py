"""Gemma 4 and its MoE / shared-KV variant (native aspect ratio, patches pooled 2 x 2 by position, bidirectional image
blocks): the checks of
tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import check_footprints, family

built = family(["gemma4", "gemma4_moe"])


def test_a_tall_image_keeps_its_aspect_ratio_in_the_token_grid(built):
    check_footprints(built, (90, 34))
