"""LLaVA, LLaVA-NeXT, LLaVA-OneVision and ViP-LLaVA: the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['llava', 'llava_next', 'onevision', 'vipllava'])
