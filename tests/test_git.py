"""GIT (``GitForCausalLM``): per-word maps against the model's own eager attention.

GIT's decoder is one self-attention over [image tokens, text tokens]; its "cross-attention"
is the text-query x image-key block of that attention (adapters/captioning.py). The oracle
reads the attention probabilities the eager model returns (and their gradients) and applies
the definitions densely: ``cross`` = mean over layers and heads of the text rows over the
image columns; ``cross_generic`` = Chefer's self-attention rule over the vision encoder, then
over the joint decoder sequence starting from the encoder's relevance for the image tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

import vitexplain as vx
from hf_helpers import sharpen_attention

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.GitConfig(
        vision_config=vision, vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    m = transformers.GitForCausalLM(config).eval()
    sharpen_attention(m)
    return m


def _eager(model):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    probs = []  # (module kind, tensor) in call order
    for name, module in ref.named_modules():
        kind = "encoder" if ".image_encoder." in f".{name}." else "decoder"
        if type(module).__name__ in ("GitVisionAttention", "GitSelfAttention"):
            module.register_forward_hook(lambda m, a, o, kind=kind: (o[1].retain_grad(), probs.append((kind, o[1])))[0])
    return ref, probs


def test_git_is_a_captioner_with_cross_methods(model):
    ex = vx.Explainer(model)
    assert ex.family == "caption" and ex.methods() == ["cross", "cross_generic", "attnlrp", "cp_lrp"]
    layout = ex.adapter.layout((32, 32))
    assert (layout.num_prefix_tokens, layout.grid) == (1, (4, 4))


def test_git_cross_and_generic_match_eager_oracle(model):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ex = vx.Explainer(model)
    generated = ex.explain_caption(x, method="cross", max_len=4)
    ids = generated.ids
    forced = {e.method: e for e in ex.explain_caption(x, method=["cross", "cross_generic"], caption=[row.tolist() for row in ids])}
    n_words = ids.shape[1]
    # the KV-cache steps stitched into one map equal the teacher-forced map of the same tokens
    torch.testing.assert_close(generated.maps, forced["cross"].maps, atol=1e-5, rtol=1e-4)

    ref, probs = _eager(model)
    inputs = torch.cat([torch.full_like(ids[:, :1], 1), ids[:, :-1]], dim=1)
    logits = ref(pixel_values=x, input_ids=inputs).logits[:, -n_words:]
    n_img = 17
    decoder = [p for kind, p in probs if kind == "decoder"]
    cross = torch.stack([p[:, :, n_img:, :n_img].mean(1) for p in decoder]).mean(0)  # (B, T, n_img)
    lengths = [len(words) for words in forced["cross"].tokens]  # maps past a caption's end are zero
    for i, n in enumerate(lengths):
        torch.testing.assert_close(forced["cross"].maps[i, :n], cross[i, :n, 1:].reshape(n, 4, 4), atol=1e-5, rtol=1e-4)

    log_probs = torch.log_softmax(logits, dim=-1)
    for word in range(n_words):
        for _, p in probs:
            p.grad = None
        log_probs[:, word].gather(1, ids[:, word : word + 1]).sum().backward(retain_graph=True)
        abar = {id(p): (p.grad * p).clamp(min=0).mean(1).detach() for _, p in probs}
        r_ii = torch.eye(n_img).expand(2, n_img, n_img)
        for kind, p in probs:
            if kind == "encoder":
                r_ii = r_ii + abar[id(p)] @ r_ii
        s = torch.zeros(2, n_img + n_words, n_img)
        s[:, :n_img] = r_ii
        for p in decoder:
            s = s + abar[id(p)] @ s
        expected = s[:, n_img + word, 1:].reshape(2, 4, 4)
        for i, n in enumerate(lengths):
            if word < n:
                torch.testing.assert_close(forced["cross_generic"].maps[i, word], expected[i], atol=1e-6, rtol=1e-4)


def test_a_generation_setting_git_cannot_take_is_refused_with_advice_that_works(model):
    """Bug: the advice named ``GenerationConfig(decoder_start_token_id=...)``, which a decoder-only GIT does not read
    (its generate starts from ``bos_token_id``; a config with only the former cannot generate). Oracle of the
    advice: the model's own generate under the advised config, and the caption explained under it."""
    broken = copy.deepcopy(model)
    broken.generation_config.forced_eos_token_id = 10**6  # outside the vocabulary: generate raises IndexError
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    ex = vx.Explainer(broken)
    with pytest.raises(vx.UnsupportedModelError, match=r"could not generate a caption \(IndexError: .*"
                                                      r"GenerationConfig\(bos_token_id=\.\.\., eos_token_id"):
        ex.explain_caption(x, method="cross", max_len=3)
    broken.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.no_grad():
        want = broken.generate(pixel_values=x, max_new_tokens=3, do_sample=False)[:, 1:]
    got = ex.explain_caption(x, method="cross", max_len=3)
    assert got.ids.tolist() == want.tolist()
