"""BLIP-2, InstructBLIP (through the Q-Former) and Kosmos-2 (through its latent-query resampler): the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['blip2', 'instructblip', 'kosmos2'])
