"""explain_caption on captioners fuzzed with other configurations than the main tests use: a Hugging Face
VisionEncoderDecoder whose decoder config lacks the start or end token, ... Tiny random-init models (plumbing);
each case names the bug it pins."""

from __future__ import annotations

import warnings

import pytest
import torch

import vitexplain as vx

transformers = pytest.importorskip("transformers")

_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def _vit_bert(start=None, end=None):
    """ViT encoder + BERT decoder as ``from_encoder_decoder_configs`` builds it: BERT has no eos token, and the
    composite config no ``decoder_start_token_id`` until the user sets them."""
    enc = transformers.ViTConfig(**_SMALL, image_size=32, patch_size=8)
    dec = transformers.BertConfig(**_SMALL, vocab_size=40, max_position_embeddings=16, is_decoder=True,
                                  add_cross_attention=True)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.pad_token_id, cfg.decoder_start_token_id = 0, start
    torch.manual_seed(0)
    model = transformers.VisionEncoderDecoderModel(cfg).eval()
    model.generation_config.eos_token_id = end
    return model


def test_generate_output_of_a_decoder_whose_start_token_is_not_its_end_token_is_warned_about():
    """``model.generate`` returns the start token first; where it is not also the end token (BERT decoders, BLIP, GIT)
    it stays a word (``e.ids`` of a caption whose first word it is read back the same), so a caption that begins with
    it is warned about, saying to pass ``ids[:, 1:]``. Oracle: those ids explain as the Explainer's own generated
    caption (words and maps); the ids as generate gives them do not."""
    model = _vit_bert(start=1, end=2)
    with torch.no_grad():  # a random head says its end token first: its logit row is zeroed
        model.decoder.cls.predictions.decoder.weight[2] = 0.0
        model.decoder.cls.predictions.bias[2] = -100.0
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    ex = vx.Explainer(model)
    generated = ex.explain_caption(x, method="cross", max_len=5)
    out = model.generate(pixel_values=x, max_new_tokens=5, do_sample=False, num_beams=1)
    assert out[:, 0].tolist() == [1, 1] and generated.ids[:, 0].ne(1).all()  # (the words themselves do not begin so)
    with pytest.warns(UserWarning, match=r"begin with the decoder's start token \(id 1\).*ids\[:, 1:\]"):
        as_generated = ex.explain_caption(x, method="cross", caption=out)
    assert as_generated.tokens != generated.tokens  # the start token read as a word
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        given = ex.explain_caption(x, method="cross", caption=out[:, 1:])
    assert given.tokens == generated.tokens
    torch.testing.assert_close(given.maps, generated.maps, rtol=1e-4, atol=1e-6)


def test_a_decoder_without_start_or_end_token_is_refused_with_what_to_set():
    """Bug: ``int(None)`` came out as a bare TypeError from the adapter's start_id / end_id, for generated and given
    captions alike. Now an UnsupportedModelError naming the config field to set; once set, the maps come out."""
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    ex = vx.Explainer(_vit_bert(end=2))
    for caption in (None, [[5, 6], [7]]):
        with pytest.raises(vx.UnsupportedModelError, match=r"decoder_start_token_id"):
            ex.explain_caption(x, method="cross", caption=caption, max_len=3)
    ex = vx.Explainer(_vit_bert(start=1))
    for caption in (None, [[5, 6], [7]]):
        with pytest.raises(vx.UnsupportedModelError, match=r"eos_token_id"):
            ex.explain_caption(x, method="cross", caption=caption, max_len=3)
    e = vx.Explainer(_vit_bert(start=1, end=2)).explain_caption(x, method="cross", caption=[[5, 6], [7]])
    assert e.maps.shape == (2, 2, 4, 4) and torch.isfinite(e.maps).all()


def _vit_trocr():
    """ViT encoder + TrOCR decoder (microsoft/trocr-*): TrOCR's attention folds the heads into the batch,
    ``softmax`` of (B * H, N_q, N_k) scores, as ``nn.MultiheadAttention`` does."""
    enc = transformers.ViTConfig(**_SMALL, image_size=32, patch_size=8)
    dec = transformers.TrOCRConfig(d_model=32, decoder_layers=2, decoder_attention_heads=2, decoder_ffn_dim=64,
                                   vocab_size=40, max_position_embeddings=20, bos_token_id=0, pad_token_id=1,
                                   eos_token_id=2, decoder_start_token_id=2)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = 2, 1
    torch.manual_seed(0)
    model = transformers.VisionEncoderDecoderModel(cfg).eval()
    with torch.no_grad():  # sharper cross-attention than a random init gives
        for layer in model.decoder.model.decoder.layers:
            layer.encoder_attn.q_proj.weight.mul_(4.0)
    return model


def test_trocr_decoder_cross_attention_is_recorded_and_matches_its_own_attentions():
    """Bug: TrOCR's decoder attention was not recorded at all (its softmax is 3-D, heads folded into the batch, which
    only nn.MultiheadAttention's was read as), so every caption method was refused with "no cross-attention was seen".
    Oracle: the model's own ``output_attentions`` cross-attentions (mean over heads and layers) on the explained
    tokens, for captions of three lengths in one batch; generated maps (KV cache) equal the teacher-forced ones."""
    model = _vit_trocr()
    ex = vx.Explainer(model)
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(11))
    captions = [[5], [6, 7, 8, 9], [10, 11]]
    cross, generic = ex.explain_caption(x, method=["cross", "cross_generic"], caption=captions)
    ids = cross.ids
    inputs = torch.cat([torch.full_like(ids[:, :1], 2), ids[:, :-1]], 1)
    with torch.no_grad():
        out = model(pixel_values=x, decoder_input_ids=inputs, output_attentions=True)
    expected = torch.stack([a.mean(1) for a in out.cross_attentions]).mean(0)[:, :, 1:]  # (B, T, 16) patch keys
    for i, words in enumerate(captions):
        n = len(words)
        torch.testing.assert_close(cross.maps[i, :n].reshape(n, 16), expected[i, :n], atol=1e-5, rtol=1e-4)
        assert torch.all(cross.maps[i, n:] == 0) and torch.all(generic.maps[i, n:] == 0)
    assert torch.isfinite(generic.maps).all() and float(generic.maps.abs().max()) > 0
    generated = ex.explain_caption(x, method="cross", max_len=4)
    forced = ex.explain_caption(x, method="cross", caption=[w.tolist()[: len(t)] or [2] for w, t in
                                                             zip(generated.ids, generated.tokens)])
    for i, words in enumerate(generated.tokens):
        torch.testing.assert_close(generated.maps[i, : len(words)], forced.maps[i, : len(words)], atol=1e-5, rtol=0)


def test_a_caption_longer_than_the_zoo_captioners_positions_says_how_many_fit():
    """Bug: a caption longer than shapes-captioner's learned positions (``max_len``) came out as the model's own
    "decoder positions up to 24 exceed max_len=12" (its internal positions, start token included); now the same
    UsageError as the other bounded decoders, naming how many words fit. Exactly that many words are explained."""
    model = vx.zoo.load("shapes-captioner")
    n = model.max_len  # the oracle: the model's own position table
    ex = vx.Explainer(model)
    x = vx.data.shapes(2, seed=41).tensor
    words = ("red circle and blue star and " * n).split()
    e = ex.explain_caption(x, method="cross", caption=" ".join(words[:n]))
    assert e.maps.shape[:2] == (2, n) and e.tokens == [words[:n]] * 2
    with pytest.raises(vx.UsageError, match=f"explain at most {n} tokens"):
        ex.explain_caption(x, method="cross", caption=" ".join(words[: n + 1]))


def _vit_gpt2(vocab: int):
    enc = transformers.ViTConfig(**_SMALL, image_size=32, patch_size=8)
    dec = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=vocab, n_positions=32, bos_token_id=1,
                                  eos_token_id=2, add_cross_attention=True, is_decoder=True)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = 1, 0
    torch.manual_seed(0)
    return transformers.VisionEncoderDecoderModel(cfg).eval()


def test_a_tokenizer_given_to_the_explainer_encodes_captions_and_names_the_words():
    """Bug: a Hugging Face captioner given a text caption was refused with "give vx.Explainer(model, tokenizer=...)",
    an argument the Explainer did not take (a bare TypeError), so its words could only be token ids. Now the
    tokenizer (or a processor holding one) encodes the text and names the words; the maps equal those of the same
    ids given as lists (oracle: the tokenizer's own ids)."""
    import vlm_helpers

    tok = vlm_helpers.tokenizer(())
    model = _vit_gpt2(len(tok))
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    captions = ["red circle", "a blue square on the left", "green"]
    with pytest.raises(vx.UsageError, match="tokenizer="):
        vx.Explainer(model).explain_caption(x, method="cross", caption=captions)
    ex = vx.Explainer(model, tokenizer=tok)
    got = ex.explain_caption(x, method="cross", caption=captions)
    ids = [tok(c, add_special_tokens=False)["input_ids"] for c in captions]
    want = vx.Explainer(model).explain_caption(x, method="cross", caption=ids)
    assert got.tokens == [c.split() for c in captions] and got.captions == captions
    torch.testing.assert_close(got.maps, want.maps, atol=0, rtol=0)
    assert torch.equal(got.ids, want.ids)

    class Processor:  # what BlipProcessor, TrOCRProcessor, ... hold
        tokenizer = tok

    assert vx.Explainer(model, tokenizer=Processor()).explain_caption(x, method="cross", caption=captions).tokens == got.tokens
    with pytest.raises(vx.UsageError, match="tokenizer= is for captioners"):
        vx.Explainer(vx.zoo.load("shapes-vit"), tokenizer=tok)


def test_gradients_that_underflow_in_float16_are_refused_not_returned_as_empty_maps():
    """Bug: BLIP (default init) in float16 gave cross_generic, attnlrp and cp_lrp maps that were all exactly zero
    (silently): its float32 gradients are ~1e-11 at the pixels, below float16's smallest number (6e-8), so the
    float16 backward underflowed to 0. Now a NumericalError that says to run in float32 or bfloat16; ``cross``
    (no gradients) still equals the float32 model's, and bfloat16 (float32's range) gives non-zero maps."""
    import copy

    import support_table

    torch.manual_seed(0)
    model = support_table._blip().eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    caption = [[5, 6, 7], [8, 9]]
    half = vx.Explainer(copy.deepcopy(model).half())
    for method in ("cross_generic", "attnlrp"):
        with pytest.raises(vx.errors.NumericalError, match="float16.*float32 or bfloat16"):
            half.explain_caption(x.half(), method=method, caption=caption)
    want = vx.Explainer(model).explain_caption(x, method="cross", caption=caption)
    got = half.explain_caption(x.half(), method="cross", caption=caption)
    torch.testing.assert_close(got.maps, want.maps, atol=2e-3, rtol=0)
    bf16 = vx.Explainer(copy.deepcopy(model).bfloat16()).explain_caption(x.bfloat16(), method="cross_generic",
                                                                           caption=caption)
    assert all(float(bf16.maps[i, : len(c)].abs().amax(dim=(-1, -2)).min()) > 0 for i, c in enumerate(caption))


def test_trocr_attention_records_and_their_gradients_are_the_models_own():
    """What cross_generic reads on TrOCR (decoder self- and cross-attention, heads folded into the batch): the
    recorded probabilities and dlog p/dA equal ``output_attentions``'s tensors and their autograd gradients."""
    model = _vit_trocr()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(12))
    ids = torch.tensor([[2, 5, 6], [2, 7, 8]])
    with vx.capture(model, grads=True) as rec:
        out = model(pixel_values=x, decoder_input_ids=ids, output_attentions=True)
        oracle = [a for pair in zip(out.decoder_attentions, out.cross_attentions) for a in pair]
        for a in oracle:
            a.retain_grad()
        rec.backward(out.logits[:, -1].log_softmax(-1)[:, 9].sum())
    decoder = [r for r in rec.records if r.name.startswith("decoder.")]
    assert [r.kind for r in decoder] == ["self", "cross"] * 2
    for record, a in zip(decoder, oracle):
        torch.testing.assert_close(record.probs(), a.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(record.grad_probs(), a.grad, atol=1e-7, rtol=1e-5)


def test_git_without_an_end_token_in_its_generation_config_uses_its_config_one():
    """GIT's end token falls back to ``model.config.eos_token_id`` when its generation config has none (a fallback
    an earlier commit on this branch dropped); with neither, an UnsupportedModelError naming what to set."""
    import support_table

    torch.manual_seed(0)
    model = support_table._git().eval()
    model.generation_config.eos_token_id = None
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    e = vx.Explainer(model).explain_caption(x, method="cross", caption=[[5, 2, 7], [6]])
    assert e.tokens == [["5"], ["6"]]  # the config's end token (2) ends the first caption
    model.config.eos_token_id = None
    with pytest.raises(vx.UnsupportedModelError, match=r"model.generation_config.eos_token_id"):
        vx.Explainer(model).explain_caption(x, method="cross", caption=[[5, 2, 7], [6]])


@pytest.mark.parametrize("size", [(17, 33), (50, 70), (66, 63)])
def test_show_attend_tell_takes_inputs_whose_sides_are_not_multiples_of_its_stride(size):
    """Bug: shapes-sat's grid was laid out as (H // 4, W // 4), but its padded stride-2 convolutions give
    ceil(H / 4) x ceil(W / 4) locations, so a 17 x 33 tensor (5 x 9 = 45 locations) was refused ("attention over 45
    tokens does not match the token layout ... = 32"). Oracle: the grid of the encoder's own feature map; the cross
    maps are the decoder's own attention weights on it."""
    model = vx.zoo.load("shapes-sat")
    x = torch.nn.functional.interpolate(vx.data.shapes(2, seed=63).tensor, size=size, mode="bilinear")
    with torch.no_grad():
        grid = tuple(model.encoder.body(x).shape[-2:])
    e = vx.Explainer(model).explain_caption(x, method="cross", max_len=4)
    assert tuple(e.maps.shape[-2:]) == grid and tuple(e.upsample().shape[-2:]) == size
    ids = e.ids
    with torch.no_grad():
        _, alphas = model.run_decoder(model.encode(x), torch.cat([torch.full_like(ids[:, :1], model.vocab.bos_id),
                                                                  ids[:, :-1]], 1))
    for i, words in enumerate(e.tokens):
        n = len(words)
        torch.testing.assert_close(e.maps[i, :n].flatten(1), alphas[i, :n], atol=1e-6, rtol=0)


def _vit_gpt2_one_special():
    """ViT encoder + GPT-2 decoder as nlpconnect/vit-gpt2-image-captioning sets it up: GPT-2's one special token is its
    start, end and padding token."""
    enc = transformers.ViTConfig(**_SMALL, image_size=32, patch_size=8)
    dec = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=40, n_positions=16, bos_token_id=3,
                                  eos_token_id=3, add_cross_attention=True, is_decoder=True)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = 3, 3
    torch.manual_seed(0)
    model = transformers.VisionEncoderDecoderModel(cfg).eval()
    with torch.no_grad():  # a random head says its special token first (an empty caption): its logit row is zeroed
        model.decoder.lm_head.weight[3] = 0.0
    return model


def _vit_trocr_speaking():
    """:func:`_vit_trocr` whose end-token logit row is zeroed: a random TrOCR says its end token first."""
    model = _vit_trocr()
    with torch.no_grad():
        model.decoder.output_projection.weight[2] = 0.0
    return model


@pytest.mark.parametrize("build", [_vit_gpt2_one_special, _vit_trocr_speaking], ids=["gpt2", "trocr"])
def test_the_ids_generate_returns_explain_the_generated_caption(build):
    """Bug: ``explain_caption(x, caption=model.generate(...))`` gave an empty explanation (no word, all-zero maps) for
    decoders whose start token is also their end token (GPT-2, TrOCR): generate's output begins with the start token,
    which was read as the caption's end. Oracle: the explanation of the caption the Explainer generates itself (its
    words and its maps); generate's padding after the end token is not a word either."""
    model = build()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    ex = vx.Explainer(model)
    generated = ex.explain_caption(x, method="cross", max_len=5)
    assert all(generated.tokens)
    out = model.generate(pixel_values=x, max_new_tokens=5, do_sample=False, num_beams=1)
    assert int(out[0, 0]) == model.config.decoder_start_token_id  # what generate puts first
    given = ex.explain_caption(x, method="cross", caption=out)
    assert given.tokens == generated.tokens
    torch.testing.assert_close(given.maps, generated.maps, rtol=1e-4, atol=1e-6)
