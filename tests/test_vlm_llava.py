"""LLaVA, LLaVA-NeXT, LLaVA-NeXT-Video (images), LLaVA-OneVision, ViP-LLaVA and Video-LLaVA (images): the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints)."""

from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(['llava', 'llava_next', 'llava_next_video', 'onevision', 'vipllava', 'video_llava'])


def test_a_vlm_family_without_an_adapter_is_refused_as_one():
    """Aria (a cross-attention projector with MoE layers) has no adapter: the refusal says it is a vision-language
    model whose geometry is not written and lists the families that are (was: the generic message, which listed ViTs
    and CNNs only). A model that is not a VLM keeps the generic message, which now names the VLMs too."""
    import pytest
    import torch
    import transformers

    import vitexplain as vx

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, moe_num_experts=2, moe_topk=1, moe_intermediate_size=32)
    cfg = transformers.AriaConfig(vision_config=vision, text_config=text, projector_patch_to_query_dict={16: 4})
    model = transformers.AriaForConditionalGeneration(cfg).eval()
    with pytest.raises(vx.UnsupportedModelError, match=r"AriaFor.*'aria'.* vision-language model whose family") as e:
        vx.Explainer(model)
    assert "LLaVA-NeXT" in str(e.value) and "docs/support.md" in str(e.value)
    with pytest.raises(vx.UnsupportedModelError, match=r"does not know how to explain.*vision-language models \(LLaVA"):
        vx.Explainer(torch.nn.Linear(3, 3))
