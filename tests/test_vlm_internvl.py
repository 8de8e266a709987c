"""InternVL, Aya Vision, Command A Vision and Qianfan-OCR (tiles plus a thumbnail, pixel shuffle): the checks of tests/vlm_checks.py (eager oracle, padded
batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['internvl', 'aya_vision', 'cohere2_vision', 'qianfan_ocr'])
