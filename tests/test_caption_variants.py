"""explain_caption over Hugging Face captioner variants a new user would build: VisionEncoderDecoder with other
decoders (RoBERTa, XLM-RoBERTa, ...) and encoders, BLIP, GIT. Tiny random-init models (plumbing); each case names the
bug it pins."""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx

transformers = pytest.importorskip("transformers")

_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def _vit_roberta(config: str = "RobertaConfig", pad: int = 1, positions: int = 20):
    """ViT encoder + a RoBERTa-style decoder: its positions are numbered from ``pad_token_id + 1`` (RoBERTa's 514-row
    table holds 512 positions)."""
    enc = transformers.ViTConfig(**_SMALL, image_size=32, patch_size=8)
    dec = getattr(transformers, config)(**_SMALL, vocab_size=40, max_position_embeddings=positions, is_decoder=True,
                                        add_cross_attention=True, bos_token_id=0, eos_token_id=2, pad_token_id=pad)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id = 0, pad, 2
    torch.manual_seed(0)
    model = transformers.VisionEncoderDecoderModel(cfg).eval()
    with torch.no_grad():  # a random head may say its end token first: its logit row is zeroed, captions run long
        model.decoder.lm_head.decoder.weight[2] = 0.0
        model.decoder.lm_head.bias[2] = -100.0
    return model


def _fits(model, length: int) -> bool:
    """Whether the model's own teacher-forced forward takes ``length`` decoder inputs (the oracle of its positions)."""
    try:
        with torch.no_grad():
            model(pixel_values=torch.zeros(1, 3, 32, 32), decoder_input_ids=torch.full((1, length), 5))
        return True
    except (IndexError, RuntimeError):
        return False


@pytest.mark.parametrize("config, pad", [("RobertaConfig", 1), ("XLMRobertaConfig", 1), ("RobertaConfig", 0)])
def test_a_roberta_decoder_explains_as_many_words_as_its_positions_hold(config, pad):
    """Bug: a RoBERTa-style decoder's positions start at ``pad_token_id + 1``, but the caption limit was its
    ``max_position_embeddings``: generating up to max_len past the table, or a caption that long, crashed inside the
    model (RuntimeError: index out of bounds in its position ids) instead of stopping at what fits / a UsageError.
    Oracle: the model's own forward, which takes ``n`` decoder inputs and not ``n + 1``."""
    model = _vit_roberta(config, pad)
    n = next(k for k in range(1, 40) if not _fits(model, k + 1))
    assert n == 20 - pad - 1  # the table's rows after the padding position
    ex = vx.Explainer(model)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    generated = ex.explain_caption(x, method="cross", max_len=1000)
    assert generated.maps.shape == (2, n, 4, 4) and all(len(t) == n for t in generated.tokens)
    assert torch.isfinite(generated.maps).all()
    given = ex.explain_caption(x, method="cross_generic", caption=[5] * n)
    assert given.maps.shape == (2, n, 4, 4) and torch.isfinite(given.maps).all()
    with pytest.raises(vx.UsageError, match=f"explain at most {n} tokens"):
        ex.explain_caption(x, method="cross", caption=[5] * (n + 1))


def _vit_prophetnet():
    """ViT encoder + ProphetNet decoder (``ProphetNetForCausalLM``, n-gram 2): its cross-attention runs over the main
    stream and the two predicting streams together."""
    enc = transformers.ViTConfig(**_SMALL, image_size=32, patch_size=8)
    dec = transformers.ProphetNetConfig(hidden_size=32, num_encoder_layers=2, num_decoder_layers=2,
                                        num_encoder_attention_heads=2, num_decoder_attention_heads=2, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, vocab_size=40, max_position_embeddings=32, bos_token_id=1,
                                        eos_token_id=2, pad_token_id=0, is_decoder=True, add_cross_attention=True,
                                        ngram=2)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id = 1, 0, 2
    torch.manual_seed(0)
    model = transformers.VisionEncoderDecoderModel(cfg).eval()
    with torch.no_grad():  # a random head may say its end token first
        model.decoder.lm_head.weight[2] = 0.0
    return model


def test_a_decoder_with_several_query_streams_is_refused_not_read_at_another_streams_row():
    """Bug: ProphetNet's decoder runs its cross-attention over [main stream, n-gram predicting streams] (3 query rows
    per token with n-gram 2): 'cross' read the last row of each decoding step, a predicting stream's, as the word's
    (generated maps differed from the teacher-forced ones of the same words by 1e-3), and cross_generic crashed with a
    raw RuntimeError (torch.cat of the two streams' self-attention). Now both are refused saying why, and the plan
    (``methods()``) does not list them (it did, then refused them).
    Oracle of the premise: the model's own ``cross_attentions`` have 3 rows per decoder input."""
    model = _vit_prophetnet()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(pixel_values=x, decoder_input_ids=torch.tensor([[1, 5, 6]] * 2), output_attentions=True)
    assert out.cross_attentions[0].shape[-2] == 3 * 3
    ex = vx.Explainer(model)
    assert ex.methods() == ["attnlrp", "cp_lrp"]  # (the plan listed 'cross' and 'cross_generic', then refused them)
    for caption in (None, [[5, 6, 7], [8]]):
        for method in ("cross", "cross_generic"):
            with pytest.raises(vx.UnsupportedMethodError, match=r"over 3 query streams per token"):
                ex.explain_caption(x, method=method, caption=caption, max_len=3)


@pytest.mark.parametrize("caption, shown", [
    (torch.tensor([[5.0, 6.0], [7.0, 8.0]]), r"\[5\.0, 6\.0\] \(float\)"),  # ids in range, as floats
    (torch.ones(2, 2, 3, dtype=torch.long), r"\[\[1, 1, 1\], \[1, 1, 1\]\] \(list\)"),  # one dimension too many
])
def test_caption_values_that_are_not_integer_ids_are_called_so(caption, shown):
    """Bug: a float tensor of ids (5.0 and 6.0, inside the 40-token vocabulary) or a 3-D tensor was refused as "token
    ids [5.0, 6.0] outside the vocabulary (0..39)", which they are not. Now the message says they are not integer
    token ids and how to give them; the same ids as integers explain."""
    model = _vit_roberta()
    ex = vx.Explainer(model)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with pytest.raises(vx.UsageError, match=shown + r", which are not token ids.*ids\.long\(\)"):
        ex.explain_caption(x, method="cross", caption=caption)
    e = ex.explain_caption(x, method="cross", caption=torch.tensor([[5.0, 6.0], [7.0, 8.0]]).long())
    assert e.ids[:, :2].tolist() == [[5, 6], [7, 8]]


@pytest.mark.parametrize("caption, shown", [({"a": 1}, r"dict \{'a': 1\}"), ({5, 6}, r"set \{5, 6\}")])
def test_a_caption_given_as_a_dict_or_set_is_called_so(caption, shown):
    """Bug: ``caption={"a": 1}`` was read as its keys and refused as "got 1 captions for 2 images", which says nothing
    of what is wrong (a set of ids would have been read in hash order). Now the message says what a caption must be
    and what was given; the same words as a list explain."""
    ex = vx.Explainer(_vit_roberta())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    with pytest.raises(vx.UsageError, match=r"caption must be text, a list of texts \(one per image\) or token ids; "
                                            r"got " + shown):
        ex.explain_caption(x, method="cross", caption=caption)
    assert ex.explain_caption(x, method="cross", caption=[5, 6]).ids[:, :2].tolist() == [[5, 6], [5, 6]]


def test_prophetnet_generates_as_many_words_as_its_positions_hold():
    """Bug: ProphetNet's positions start at ``pad_token_id + 1`` and its n-gram predicting streams read the row after
    each input's, but the caption limit was its ``max_position_embeddings``: generating up to max_len raised a raw
    IndexError from inside ``generate`` (with its KV cache), and a caption that long was teacher-forced with positions
    clamped to the table's last row, silently. Now generation stops where the positions run out and a longer caption
    is refused. Oracle: the model's own ``generate``, which makes ``n`` new tokens and not ``n + 1``."""
    model = _vit_prophetnet()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))

    def generates(k):
        try:
            with torch.no_grad():
                model.generate(pixel_values=x, max_new_tokens=k, min_new_tokens=k, decoder_start_token_id=1,
                               eos_token_id=2, pad_token_id=0)
            return True
        except IndexError:
            return False

    n = next(k for k in range(1, 40) if not generates(k + 1))
    assert n == 32 - 0 - 2  # the table's rows after the padding position, less the predicting stream's one more
    ex = vx.Explainer(model)
    e = ex.explain_caption(x, method="cp_lrp", max_len=1000, resolution="patches")
    assert e.maps.shape == (2, n, 4, 4) and all(len(t) == n for t in e.tokens) and torch.isfinite(e.maps).all()
    with pytest.raises(vx.UsageError, match=f"explain at most {n} tokens"):
        ex.explain_caption(x, method="cp_lrp", caption=[5] * (n + 1))


def _vit_decoder(config: str, **settings):
    enc = transformers.ViTConfig(**_SMALL, image_size=32, patch_size=8)
    dec = getattr(transformers, config)(**_SMALL, vocab_size=40, max_position_embeddings=20, is_decoder=True,
                                        add_cross_attention=True, bos_token_id=0, eos_token_id=2, pad_token_id=1,
                                        **settings)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id = 0, 1, 2
    torch.manual_seed(0)
    return transformers.VisionEncoderDecoderModel(cfg).eval()


@pytest.mark.parametrize("config, error, runs", [("XmodConfig", "ValueError", False),
                                                 ("MegatronBertConfig", "RuntimeError", False),
                                                 ("BigBirdConfig", "AttributeError", True)])
def test_a_decoder_generate_cannot_run_is_refused_saying_what_to_do(config, error, runs):
    """Bug: decoders Hugging Face's ``generate`` cannot run in a VisionEncoderDecoder gave raw errors from inside
    transformers: X-MOD (ValueError: no language set), Megatron-BERT (RuntimeError: a size mismatch in its own
    cross-attention forward), BigBird (AttributeError from its KV cache). Now each is an UnsupportedModelError that
    carries the model's message and says what to do; a given caption is explained where the model's own forward runs
    (BigBird), and is refused the same way where it does not. Oracle of the premise: the model's own calls."""
    model = _vit_decoder(config)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    with pytest.raises(Exception) as raw:
        model.generate(pixel_values=x, max_new_tokens=3)
    assert type(raw.value).__name__ == error
    ex = vx.Explainer(model)
    with pytest.raises(vx.UnsupportedModelError, match=rf"could not generate a caption \({error}: .*caption=\.\.\."):
        ex.explain_caption(x, method="cross", max_len=3)
    if runs:
        assert ex.explain_caption(x, method="cross", caption=[5, 6]).maps.shape == (2, 2, 4, 4)
    else:
        with pytest.raises(vx.UnsupportedModelError, match=r"could not run on the caption \(" + error):
            ex.explain_caption(x, method="cross", caption=[5, 6])
    fix = {"XmodConfig": lambda: model.decoder.set_default_language("en_XX"),  # what the two messages advise
           "BigBirdConfig": lambda: setattr(model.generation_config, "use_cache", False)}.get(config)
    if fix is not None:
        fix()
        with torch.no_grad():
            want = model.generate(pixel_values=x, max_new_tokens=3, do_sample=False)[:, 1:]
        assert ex.explain_caption(x, method="cross", max_len=3).ids.tolist() == want.tolist()


def _vit_mae_bert(mask_ratio: float = 0.75):
    enc = transformers.ViTMAEConfig(**_SMALL, image_size=32, patch_size=8, mask_ratio=mask_ratio)
    dec = transformers.BertConfig(**_SMALL, vocab_size=40, max_position_embeddings=20, is_decoder=True,
                                  add_cross_attention=True, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id = 0, 1, 2
    torch.manual_seed(0)
    return transformers.VisionEncoderDecoderModel(cfg).eval()


@pytest.mark.parametrize("mask_ratio", [0.75, 0.0])
def test_a_vit_mae_encoder_is_listed_with_no_caption_method_and_says_why(mask_ratio):
    """Bug: a VisionEncoderDecoder over a ViT-MAE encoder listed 'cross' (and cross_generic, attnlrp, cp_lrp) in
    ``methods()``, then refused it saying no token layout was known. ViT-MAE masks and shuffles its patch tokens at
    random on every forward, in eval mode and with mask_ratio=0 too, so no map can be right: the plan now lists none
    and gives that reason, the same one the refusal gives. Oracle of the premise: two eval forwards of the encoder
    on one image differ, and with mask_ratio 0.75 it returns 1 + 16 * 0.25 tokens, not 17."""
    model = _vit_mae_bert(mask_ratio)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a, b = (model.encoder(pixel_values=x).last_hidden_state for _ in range(2))
    assert a.shape[1] == 1 + int(16 * (1 - mask_ratio)) and not torch.allclose(a, b)
    ex = vx.Explainer(model)
    assert ex.methods() == []
    why = rf"the image encoder \(ViTMAEModel\) drops a random {mask_ratio:g} of its patch tokens .* random order"
    with pytest.raises(vx.UnsupportedModelError, match=r"cross, cross_generic, attnlrp, cp_lrp: " + why):
        ex.plan()
    for method in ("cross", "cross_generic"):
        with pytest.raises(vx.UnsupportedMethodError, match=why):
            ex.explain_caption(x, method=method, max_len=3)


def test_the_batch_probe_of_a_decoder_that_cannot_run_says_what_to_do():
    """Bug: ``vitexplain caption``'s probe of the next-word scores (before any file) ran the teacher-forced forward
    outside the clear-error rule: X-MOD without a language raised transformers' raw ValueError there. Oracle of the
    premise: the model's own forward raises it."""
    from vitexplain.batch.checks import check_captioner_outputs

    model = _vit_decoder("XmodConfig")
    with pytest.raises(ValueError):
        model(pixel_values=torch.zeros(1, 3, 32, 32), decoder_input_ids=torch.tensor([[0, 2]]))
    adapter = vx.Explainer(model).adapter
    with pytest.raises(vx.UnsupportedModelError, match=r"could not run on the caption \(ValueError: .*set_default_language"):
        check_captioner_outputs(adapter, torch.device("cpu"), None, (32, 32))
    model.decoder.set_default_language("en_XX")  # what the message advises: the probe then passes
    check_captioner_outputs(adapter, torch.device("cpu"), None, (32, 32))
