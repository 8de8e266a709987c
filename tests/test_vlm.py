"""Vision-language models: input errors, options, and the model left as found.

The per-family checks (eager-attention oracle, padded batches, greedy generation, token footprints)
are in tests/vlm_checks.py and run by tests/test_vlm_*.py, one file per group of families.
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
import vlm_helpers as helpers

PROMPTS = ["what is", "what color is the shape"]


@pytest.mark.parametrize("name", ["llava", "qwen2_vl", "gemma3", "idefics3"])  # one model per kind of adapter
def test_the_model_is_left_as_found(name):
    model, proc = helpers.BUILDERS[name]()
    with torch.no_grad():  # transformers installs its own output-capturing hooks on the first call
        model.generate(**proc(images=helpers.images(5)[:1], text=[helpers.ORACLE[name]["prompt"]("a")], return_tensors="pt"),
                       max_new_tokens=2, suppress_tokens=helpers.ORACLE[name]["placeholders"](model))
    hooks = {n: (list(m._forward_hooks), list(m._forward_pre_hooks)) for n, m in model.named_modules()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {n: getattr(m.config, "_attn_implementation", None) for n, m in model.named_modules() if hasattr(m, "config")}
    vx.Explainer(model, processor=proc).explain_caption(helpers.images(5), method="cross_generic", prompt=PROMPTS, max_len=2)
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    assert {n: getattr(m.config, "_attn_implementation", None) for n, m in model.named_modules() if hasattr(m, "config")} == modes
    assert {n: (list(m._forward_hooks), list(m._forward_pre_hooks)) for n, m in model.named_modules()} == hooks
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())




@pytest.mark.parametrize("name, dropped, reason", [
    ("qwen2_vl", "mm_token_type_ids", "M-RoPE"),  # without them generate silently falls back to 1-D positions
    ("paligemma", "token_type_ids", "prefix mask"),
    ("gemma4", "mm_token_type_ids", "mask"),
    ("gemma4", "image_position_ids", "positions"),
])
def test_a_processor_output_the_model_needs_missing_is_an_error(name, dropped, reason):
    """A processor (or a user's wrapper) that leaves out an input the model reads (positions, token types for its
    mask) would let the model run on defaults and explain another computation: the adapter refuses, naming it."""
    model, proc = helpers.BUILDERS[name]()

    class Dropping:
        def __init__(self, inner):
            self.inner, self.tokenizer, self.image_processor = inner, inner.tokenizer, inner.image_processor
            self.image_token = inner.image_token

        def __call__(self, **kwargs):
            batch = self.inner(**kwargs)
            del batch[dropped]
            return batch

    with pytest.raises(vx.UnsupportedModelError, match=f"gave no {dropped}, which .* needs .*{reason}"):
        vx.Explainer(model, processor=Dropping(proc)).explain_caption(helpers.images(8), prompt="what is", max_len=2)


def test_a_vlm_needs_its_processor_and_images():
    model, proc = helpers.BUILDERS["llava"]()
    with pytest.raises(vx.UsageError, match="pass its processor"):
        vx.Explainer(model).explain_caption(helpers.images(9))
    with pytest.raises(vx.InputError, match="takes images"):
        vx.Explainer(model, processor=proc).explain_caption(torch.rand(1, 3, 32, 32))
    with pytest.raises(vx.UsageError, match="standing for the image"):
        vx.Explainer(model, processor=proc).explain_caption(helpers.images(9), caption=[model.config.image_token_id])
    with pytest.raises(vx.UsageError, match="processor= is for vision-language models"):
        from timm.models.vision_transformer import VisionTransformer

        vx.Explainer(VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2), processor=proc)


def test_cross_options_pick_layers_and_heads_as_the_eager_oracle_does():
    """``heads=[(layer, head), ...]`` averages exactly those heads; ``layers`` and ``head_fusion`` as documented."""
    import vlm_checks as checks

    model, proc = helpers.BUILDERS["llava"]()
    images = helpers.images(10)
    answers = checks._answer_ids(proc, checks.ANSWERS)
    kwargs, start, ids, columns = checks._oracle_inputs("llava", model, proc, images, PROMPTS, answers)
    with torch.no_grad():
        atts = helpers.eager_copy(model)(**kwargs, output_attentions=True, use_cache=False).attentions
    rows = slice(start - 1, start - 1 + ids.shape[1])
    lengths = [len(a) for a in answers]
    ex = vx.Explainer(model, processor=proc)
    cases = {
        "heads": (dict(heads=[(0, 1), (1, 3), (-1, 0)]),
                  (atts[0][:, 1, rows] + atts[1][:, 3, rows] + atts[1][:, 0, rows]) / 3),
        "last layer, max": (dict(layers=-1, head_fusion="max"), atts[1][:, :, rows].amax(1)),
        "layers": (dict(layers=[0, 1], head_fusion="min"), (atts[0][:, :, rows].amin(1) + atts[1][:, :, rows].amin(1)) / 2),
    }
    for label, (options, want) in cases.items():
        e = ex.explain_caption(images, method="cross", caption=answers, prompt=PROMPTS, **options)
        for b, cols in enumerate(columns):
            expected = want[b][:, cols].clone()
            expected[lengths[b]:] = 0
            torch.testing.assert_close(e.token_scores[b], expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"{label}: {m}")
    with pytest.raises(vx.OptionError, match="heads"):
        ex.explain_caption(images, method="cross", caption=answers, prompt=PROMPTS, heads=[(0, 9)])
    with pytest.raises(vx.OptionError, match="layers"):
        ex.explain_caption(images, method="cross", caption=answers, prompt=PROMPTS, layers=5)


def test_a_prompt_the_processor_refuses_is_an_input_error_that_says_why():
    model, proc = helpers.BUILDERS["llava"]()
    ex = vx.Explainer(model, processor=proc)
    with pytest.raises(vx.InputError, match="refused the prompts .* with 2 image.*number of <image> tokens") as err:
        ex.explain_caption(helpers.images(1), prompt=["<image> <image> what", "what"], max_len=2)
    assert isinstance(err.value.__cause__, ValueError)  # the processor's own message is kept
