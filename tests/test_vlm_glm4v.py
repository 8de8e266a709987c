"""GLM-4.1V (Qwen2-VL's geometry and M-RoPE, its own image tokens): the checks of tests/vlm_checks.py (eager oracle,
padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['glm4v'])
