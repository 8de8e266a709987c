"""Captioning: per-word cross-attention and encoder-decoder relevance.

Oracles: Hugging Face models' own eager attentions, ``nn.MultiheadAttention(need_weights=True)``,
and for the zoo captioner an explicit-softmax stand-in for SDPA (test code only) that keeps the
attention probabilities and their gradients.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitexplain as vx
from vitexplain.errors import UnsupportedMethodError
from vitexplain.zoo.captioner import Captioner
from vitexplain.adapters.captioning import TransformerDecoderCaptioner
from vitexplain.zoo.models import caption_words


@pytest.fixture(scope="module")
def captioner() -> Captioner:
    torch.manual_seed(0)
    m = Captioner(caption_words(), enc_depth=2, dec_depth=2).eval()
    with torch.no_grad():  # sharper attention than a random init gives
        for layer in m.layers:
            layer.cross_attn.q.weight.mul_(6.0)
    return m


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def test_generated_with_cache_equals_teacher_forced(captioner, images):
    ex = vx.Explainer(captioner)
    generated = ex.explain_caption(images, method=["cross", "cross_generic"], max_len=6)
    ids = generated[0].ids
    assert generated[0].maps.shape == (3, ids.shape[1], 8, 8)
    forced = ex.explain_caption(images, method=["cross", "cross_generic"], caption=ids.tolist())
    for g, f in zip(generated, forced):
        assert g.tokens == f.tokens
        torch.testing.assert_close(g.maps, f.maps, atol=1e-5, rtol=0)
    # the explained tokens are the model's own greedy generation
    with torch.no_grad():
        own, _ = captioner.generate(images, max_len=6)
    assert torch.equal(ids, own[:, : ids.shape[1]])


def explicit_sdpa(kept):
    """A stand-in for F.scaled_dot_product_attention with an explicit softmax (test oracle)."""

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        if is_causal:
            n_q, n_k = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(n_q, n_k).triu(1).bool(), float("-inf"))
        attn = scores.softmax(-1)
        attn.retain_grad()
        kept.append(attn)
        return attn @ v

    return sdpa


def test_cross_and_cross_generic_match_hand_oracle(captioner, images, monkeypatch):
    ex = vx.Explainer(captioner)
    cross, generic = ex.explain_caption(images[:2], method=["cross", "cross_generic"], max_len=5)
    for i in range(2):
        words = generic.tokens[i]
        ids = captioner.tokenize([" ".join(words)])[:, 1:]  # word ids + <eos>
        t = len(words)
        kept: list[torch.Tensor] = []
        monkeypatch.setattr(F, "scaled_dot_product_attention", explicit_sdpa(kept))
        x = images[i : i + 1].clone().requires_grad_(True)
        inputs = torch.cat([torch.tensor([[captioner.vocab.bos_id]]), ids[:, :-1]], dim=1)[:, :t]
        logits = captioner(x, inputs)
        monkeypatch.undo()
        # encoder: 2 self; decoder: per layer self then cross
        enc, dec = kept[:2], kept[2:]
        # cross: mean over heads and layers of the cross rows, patch keys
        cross_rows = torch.stack([dec[1][0].mean(0), dec[3][0].mean(0)]).mean(0)[:, 1:]
        torch.testing.assert_close(cross.maps[i, :t].reshape(t, 64), cross_rows.detach(), atol=1e-5, rtol=1e-4)
        for w in range(t):
            for a in kept:
                a.grad = None
            logp = torch.log_softmax(logits[0, w], -1)[ids[0, w]]
            logp.backward(retain_graph=True)
            abar = [(a.grad[0] * a[0].detach()).clamp(min=0).mean(0) for a in kept]
            r_ii = torch.eye(65)
            for m in abar[:2]:
                r_ii = r_ii + m @ r_ii
            r_tt, r_ti = torch.eye(t), torch.zeros(t, 65)

            def nb(r):
                off = r - torch.eye(r.shape[0])
                s = off.sum(-1, keepdim=True)
                return torch.where(s == 0, torch.zeros_like(off), off / torch.where(s == 0, torch.ones_like(s), s)) + torch.eye(r.shape[0])

            for k, m in enumerate(abar[2:]):
                if k % 2 == 0:  # decoder self-attention
                    r_tt, r_ti = r_tt + m @ r_tt, r_ti + m @ r_ti
                else:
                    r_ti = r_ti + nb(r_tt).T @ m @ nb(r_ii)
            torch.testing.assert_close(generic.maps[i, w].reshape(64), r_ti[w, 1:], atol=1e-5, rtol=1e-4)
        assert torch.all(generic.maps[i, t:] == 0)


def test_given_caption_and_errors(captioner, images):
    ex = vx.Explainer(captioner)
    e = ex.explain_caption(images[:2], method="cross", caption="red circle and blue star")
    assert e.tokens == [["red", "circle", "and", "blue", "star"]] * 2
    assert e.captions == ["red circle and blue star"] * 2
    per_image = ex.explain_caption(images[:2], method="cross", caption=["red circle", "blue star and green cross"])
    assert [len(t) for t in per_image.tokens] == [2, 5]
    assert torch.all(per_image.maps[0, 2:] == 0) and per_image.maps.shape[1] == 5
    with pytest.raises(KeyError, match="not in the vocabulary"):
        ex.explain_caption(images[:1], method="cross", caption="purple dog")
    with pytest.raises(UnsupportedMethodError, match="explain_caption"):
        ex.explain(images, method="cdam")
    with pytest.raises(UnsupportedMethodError, match="is for vit/swin/hier models.*is a caption model"):
        ex.explain_caption(images, method="rollout")


def test_caption_figure(captioner, images):
    rgb = (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)
    e = vx.Explainer(captioner).explain_caption(images[:1], method="cross", max_len=4)
    fig = e.figure(0, image=rgb)
    assert fig.dtype == np.uint8 and fig.ndim == 3 and fig.shape[2] == 3
    assert fig.shape[1] > fig.shape[0]  # image + one tile per word in a row
    figure = vx.viz.caption_figure(rgb, ["a", "b"], torch.rand(2, 8, 8))
    assert figure.shape[2] == 3


def test_transformer_decoder_captioner_matches_mha_oracle():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=0)
    model = TransformerDecoderCaptioner(encoder, vocab_size=12, dim=16, depth=2, heads=2).eval()
    x = torch.randn(2, 3, 32, 32)
    ex = vx.Explainer(model)
    generated, generic = ex.explain_caption(x, method=["cross", "cross_generic"], max_len=4)
    forced = ex.explain_caption(x, method="cross", caption=generated.ids.tolist())
    torch.testing.assert_close(generated.maps, forced.maps, atol=1e-5, rtol=0)
    assert torch.isfinite(generic.maps).all()
    # oracle: each cross-attention module's own need_weights=True on its recorded inputs
    inputs = []
    hooks = [layer.multihead_attn.register_forward_pre_hook(lambda m, a, kw: inputs.append((m, a, kw)), with_kwargs=True) for layer in model.decoder.layers]
    ids = generated.ids
    t = ids.shape[1]
    with torch.no_grad():
        model(x, torch.cat([torch.full_like(ids[:, :1], model.start_id), ids[:, :-1]], 1))
    for h in hooks:
        h.remove()
    rows = []
    for m, a, kw in inputs:
        with torch.no_grad():
            _, w = m(*a, **{**kw, "need_weights": True, "average_attn_weights": False})
        rows.append(w.mean(1)[:, :, 1:])
    expected = torch.stack(rows).mean(0)
    lengths = [len(tok) for tok in forced.tokens]
    for i, n in enumerate(lengths):
        torch.testing.assert_close(forced.maps[i, :n].reshape(n, 16), expected[i, :n], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def transformers():
    """Hugging Face transformers: optional for the package, installed by the test extra (so CI runs
    these tests); only the tests that build Hugging Face models need it."""
    return pytest.importorskip("transformers")


def hf_vision_encoder_decoder(transformers, attn: str):
    enc = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)
    dec = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=40, n_positions=32, add_cross_attention=True,
        is_decoder=True, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id = 0, 1, 1
    torch.manual_seed(0)
    model = transformers.VisionEncoderDecoderModel(config=cfg).eval()
    model.set_attn_implementation(attn)
    return model


def hf_blip(transformers, attn: str):
    cfg = transformers.BlipConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8),
        text_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=50,
            encoder_hidden_size=32, max_position_embeddings=32, bos_token_id=3, sep_token_id=4, pad_token_id=0,
        ),
    )
    torch.manual_seed(0)
    model = transformers.BlipForConditionalGeneration(cfg).eval()
    try:
        model.set_attn_implementation(attn)
    except (ValueError, NotImplementedError):
        pytest.skip(f"BLIP does not support attn_implementation={attn!r} in this transformers version")
    return model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("build", [hf_vision_encoder_decoder, hf_blip], ids=["vit-gpt2", "blip"])
def test_hf_captioners_cross_attention_matches_eager(transformers, build, attn):
    model = build(transformers, attn)
    x = torch.randn(2, 3, 32, 32)
    ex = vx.Explainer(model)
    assert ex.family == "caption"
    generated, generic = ex.explain_caption(x, method=["cross", "cross_generic"], max_len=4)
    forced = ex.explain_caption(x, method="cross", caption=generated.ids.tolist())
    torch.testing.assert_close(generated.maps, forced.maps, atol=1e-5, rtol=0)
    assert torch.isfinite(generic.maps).all() and generic.maps.abs().sum() > 0
    # oracle: the model's own eager cross-attentions on the same tokens
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    ids = forced.ids
    start = torch.full_like(ids[:, :1], ex.adapter.start_id)
    inputs = torch.cat([start, ids[:, :-1]], 1)
    with torch.no_grad():
        if build is hf_vision_encoder_decoder:
            out = ref(pixel_values=x, decoder_input_ids=inputs, output_attentions=True)
            cross = out.cross_attentions
        else:
            # BLIP's text decoder returns (self, cross) attentions interleaved per layer
            embeds = ref.vision_model(pixel_values=x).last_hidden_state
            out = ref.text_decoder(input_ids=inputs, encoder_hidden_states=embeds, output_attentions=True)
            cross = out.cross_attentions
    expected = torch.stack([c.mean(1) for c in cross]).mean(0)[:, :, 1:]
    for i, words in enumerate(forced.tokens):
        n = len(words)
        torch.testing.assert_close(forced.maps[i, :n].reshape(n, 16), expected[i, :n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "name, method, floor",
    [
        # measured on these images, minus three binomial standard errors sqrt(p (1 - p) / n),
        # rounded down to 2 decimals; n = the colour and shape words of the 60 captions
        ("shapes-captioner", "cross", 0.96),  # measured 0.987, n = 238
        ("shapes-captioner", "cross_generic", 0.87),  # measured 0.929, n = 238
        # shapes-sat (Show, Attend and Tell): measured 0.971 (cross) and 0.874 (cross_generic) on these
        # 238 words, 0.962 and 0.863 over 2,000 words (benchmarks/faithfulness.py --captioners-only);
        # floors = the 2,000-word value - 3 binomial standard errors at 238 words, rounded down
        ("shapes-sat", "cross", 0.92),
        ("shapes-sat", "cross_generic", 0.79),
    ],
)
def test_zoo_captioner_words_point_at_their_object(name, method, floor):
    """Every color or shape word of the true caption: the map's maximum lies on the object it names.

    Fresh images (seed 30,000; training uses seeds < 9,000), the caption explained teacher-forced.
    """
    from vitexplain.data import COLORS, SHAPES

    model = vx.zoo.load(name)
    batch = vx.data.shapes(60, seed=30_000)
    result = vx.Explainer(model).explain_caption(batch.tensor, method=method, caption=batch.captions)
    content = set(SHAPES) | set(COLORS)
    hits = []
    for i, caption in enumerate(batch.captions):
        words = caption.split(" ")
        assert result.tokens[i][: len(words)] == words
        for w, (word, obj) in enumerate(zip(words, batch.word_objects[i])):
            if word in content:
                hit = vx.metrics.pointing_game(result.maps[i, w][None], batch.masks[i][obj][None])
                hits.append(bool(hit[0]))
    accuracy = sum(hits) / len(hits)
    print(f"{name} {method} per-word pointing: {accuracy:.3f} over {len(hits)} words")
    assert accuracy >= floor, f"{method}: per-word pointing {accuracy:.3f} < {floor}"


def test_cross_generic_on_a_frozen_captioner(captioner, images):
    """``requires_grad_(False)``: the decoder's first self-attention over the caption's words was in no autograd
    graph and ``cross_generic`` raised; it now equals the unfrozen captioner's, the copy stays frozen and hookless."""
    import copy

    frozen = copy.deepcopy(captioner).requires_grad_(False)
    want = vx.Explainer(captioner).explain_caption(images, method="cross_generic", max_len=4)
    got = vx.Explainer(frozen).explain_caption(images, method="cross_generic", max_len=4)
    assert got.tokens == want.tokens and float(want.maps.abs().max()) > 0
    torch.testing.assert_close(got.maps, want.maps, atol=1e-6, rtol=1e-5)
    assert not any(p.requires_grad or p.grad is not None for p in frozen.parameters())
    assert not any(m._forward_hooks for m in frozen.modules())
