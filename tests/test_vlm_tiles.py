"""Idefics3 and SmolVLM (tiles and a global image): the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['idefics3', 'smolvlm'])
