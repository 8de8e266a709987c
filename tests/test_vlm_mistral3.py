"""Mistral 3 (Pixtral tower, 2 x 2 patch merger, row-break tokens), LightOnOCR (the same without row breaks) and
Pixtral-12B (LLaVA with a Pixtral tower): the checks of tests/vlm_checks.py (eager oracle,
padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['mistral3', 'pixtral', 'lighton_ocr'])
