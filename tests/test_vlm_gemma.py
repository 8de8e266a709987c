"""PaliGemma, PaliGemma 2 and Gemma 3: the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['paligemma', 'paligemma2', 'gemma3'])
