"""LLaVA, LLaVA-NeXT, LLaVA-NeXT-Video (images), LLaVA-OneVision and ViP-LLaVA: the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['llava', 'llava_next', 'llava_next_video', 'onevision', 'vipllava'])


def test_a_vlm_family_without_an_adapter_is_refused_as_one():
    """Video-LLaVA (separate image and video towers) has no adapter: the refusal says it is a vision-language model
    whose geometry is not written and lists the families that are (was: the generic message, which listed ViTs and
    CNNs only). A model that is not a VLM keeps the generic message, which now names the VLMs too."""
    import pytest
    import torch
    import transformers

    import vitexplain as vx
    from vlm_helpers import _text

    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=16, patch_size=4)
    cfg = transformers.VideoLlavaConfig(vision_config=vision, text_config=dict(model_type="llama", vocab_size=40, **_text()))
    model = transformers.VideoLlavaForConditionalGeneration(cfg).eval()
    with pytest.raises(vx.UnsupportedModelError, match=r"VideoLlava.*'video_llava'.* vision-language model whose family") as e:
        vx.Explainer(model)
    assert "LLaVA-NeXT" in str(e.value) and "docs/support.md" in str(e.value)
    with pytest.raises(vx.UnsupportedModelError, match=r"does not know how to explain.*vision-language models \(LLaVA"):
        vx.Explainer(torch.nn.Linear(3, 3))
