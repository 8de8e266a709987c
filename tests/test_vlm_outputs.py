"""What a vision-language model's explanation is turned into: figures, matrices, pages (tiny random-init LLaVA).

The maps themselves are checked against an eager-attention oracle in tests/vlm_checks.py; here the views of an
explanation of images of different sizes and aspect ratios must show those maps, not another array of them.
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
import vlm_helpers as helpers


@pytest.fixture(scope="module")
def explained():
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS["llava"]()
    images = helpers.images(51, ((33, 61), (77, 19)))  # wide and tall, neither the processor's 32 x 32
    e = vx.Explainer(model, processor=proc).explain_caption(images, method="cross", prompt=["what is", "a"],
                                                            caption=["red circle on", "blue"])
    return e, images


def test_caption_matrix_of_a_vlm_is_words_by_image_tokens(explained):
    """vx.viz.caption_matrix flattened a VLM's (T, H, W) pixel maps (the batch's largest size, resampled) into
    H x W "patch" columns: a 77 x 61 batch drew 4697 columns, a figure 9500 px wide, silently. Now its columns are the
    image's tokens the language model sees (``token_scores``), as they are the patches of a captioner's matrix, and an
    image index out of range is a UsageError (it raised a bare IndexError)."""
    e, _ = explained
    for index in (0, 1, -1):
        words = e.tokens[index]
        want = vx.viz.attention_matrix(e.token_scores[index][: len(words)], words,
                                       [str(i) for i in range(16)], f"cross: {e.captions[index]}")
        got = vx.viz.caption_matrix(e, index)
        assert got.shape == want.shape and got.shape[1] < 2000
        assert (got == want).all()
    with pytest.raises(vx.UsageError, match="image index"):
        vx.viz.caption_matrix(e, 2)
