"""Qwen3.5 and Qwen3.5-MoE (Qwen3-VL's tower and M-RoPE; a hybrid language model, linear attention with a softmax
layer every few): the checks of tests/vlm_checks.py (eager oracle, padded batch, greedy answer, footprints) for cross
and cross_grad, and cross_generic refused with the reason."""

import pytest
import torch

import vitexplain as vx
import vlm_helpers as helpers
from vlm_checks import *  # noqa: F401,F403  (the tests)
from vlm_checks import family

built = family(["qwen3_5", "qwen3_5_moe"])


def test_only_the_attention_layers_are_read_and_chefers_rules_are_refused(built):
    name, model, proc = built
    ex = vx.Explainer(model, processor=proc)
    assert ex.methods() == ["cross", "cross_grad"]
    with pytest.raises(vx.UnsupportedMethodError, match=r"2 of the 4 language-model layers .* linear attention"):
        ex.explain_caption(helpers.images(1)[:1], method="cross_generic", prompt="what is")
    image = helpers.images(2)[:1]
    with vx.capture(model) as rec, torch.no_grad():
        model(**proc(images=image, text=["<|vision_start|><|image_pad|><|vision_end|>what is"], return_tensors="pt"))
    lm = [r.name for r in rec.records if r.name.startswith("model.language_model.")]
    full = [i for i, t in enumerate(model.config.text_config.layer_types) if t == "full_attention"]
    assert lm == [f"model.language_model.layers.{i}.self_attn" for i in full]  # layers=[k] is the k-th of these
    first = ex.explain_caption(image, method="cross", prompt="what is", caption=["red circle"], layers=[0])
    both = ex.explain_caption(image, method="cross", prompt="what is", caption=["red circle"])
    last = ex.explain_caption(image, method="cross", prompt="what is", caption=["red circle"], layers=[-1])
    torch.testing.assert_close(both.token_scores[0], (first.token_scores[0] + last.token_scores[0]) / 2)
