"""What a vision-language model is given: images of any shape reach its processor as the user's pixels.

Tiny random-init builds (``tests/vlm_helpers.py``, ``tests/encdec_helpers.py``), one per way the
processor is called (LLaVA: the base adapter's batch; Idefics3: its tile count too; Pix2Struct: the
encoder-decoder batch). The expectation is the eager oracle of the family's checks fed PIL images,
whose layout a processor cannot misread.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import vitexplain as vx
import encdec_helpers
import test_vlm_encdec
import vlm_checks
import vlm_helpers as helpers

ANSWERS = [["red", "circle"]]


@pytest.mark.parametrize("name", ["llava", "idefics3", "pix2struct"])
@pytest.mark.parametrize("size", [(3, 45), (1, 37), (4, 3)])
def test_an_image_one_or_three_pixels_thin_is_not_read_as_channels_first(name, size):
    """transformers guesses channels-first for some arrays with a side of 1 or 3 pixels;
    the maps of such an array equal the oracle's on the same pixels given as a PIL image."""
    torch.manual_seed(0)
    builders = {**helpers.BUILDERS, **encdec_helpers.BUILDERS}
    model, proc = builders[name]()
    image = helpers.images(11, (size,))[0]
    answers = [[proc.tokenizer.convert_tokens_to_ids(w) for w in ws] for ws in ANSWERS]
    got = vx.Explainer(model, processor=proc).explain_caption([image], method="cross", caption=answers, prompt="what is")
    checks = test_vlm_encdec if name in encdec_helpers.BUILDERS else vlm_checks
    want = checks.oracle(name, model, proc, [Image.fromarray(image)], ["what is"], answers)["cross"]
    torch.testing.assert_close(got.token_scores[0], want[0], atol=1e-5, rtol=1e-4)
    assert got.image_maps[0].shape == (len(ANSWERS[0]), *size)
    assert bool(torch.isfinite(got.image_maps[0]).all())
