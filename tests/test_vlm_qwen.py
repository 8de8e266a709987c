"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and EXAONE 4.5 (Qwen2.5-VL's tower, 1-D positions): the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['qwen2_vl', 'qwen2_5_vl', 'qwen3_vl', 'qwen3_vl_moe', 'exaone4_5'])
