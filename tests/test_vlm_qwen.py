"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['qwen2_vl', 'qwen2_5_vl', 'qwen3_vl', 'qwen3_vl_moe'])
