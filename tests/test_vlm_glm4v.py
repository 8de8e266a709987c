"""GLM-4.1V, GLM-4.5V (experts), GLM-4.6V and GLM-OCR (Qwen2-VL's geometry and M-RoPE, its own image tokens): the checks of tests/vlm_checks.py (eager oracle,
padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['glm4v', 'glm4v_moe', 'glm46v', 'glm_ocr'])
