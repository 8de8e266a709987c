"""explain_caption on inputs at the edges: captions longer than the decoder's position
embeddings, generation asked for more tokens than fit, and images of any size preprocessed for a
captioner assembled over a timm ViT. Tiny random-init models (the checks are about plumbing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitexplain as vx
from vitexplain.errors import UsageError
from support_table import rows

_ROWS = {r.name: r for r in rows() if r.group == "captioner"}
_BOUNDED = ["nn.TransformerDecoder over timm ViT", "HF VisionEncoderDecoder (ViT + GPT-2)", "HF BLIP", "HF GIT"]


def _positions(model: torch.nn.Module) -> int:
    """Position embeddings of the decoder, read from the model itself (the oracle)."""
    if hasattr(model, "pos"):
        return int(model.pos.shape[1])
    config = model.config
    text = config.decoder if hasattr(config, "decoder") else getattr(config, "text_config", config)
    return int(text.max_position_embeddings)


@pytest.mark.parametrize("name", _BOUNDED)
def test_caption_longer_than_the_decoder_is_a_usage_error(name):
    torch.manual_seed(0)
    model = _ROWS[name].build().eval()
    ex = vx.Explainer(model)
    n = _positions(model)
    x = torch.randn(2, 3, *_ROWS[name].size)
    # n words are teacher-forced from n inputs (the start token and the first n - 1 words)
    fits = ex.explain_caption(x, method="cross_generic", caption=[[5] * n, [6]])
    assert fits.maps.shape[:2] == (2, n) and torch.isfinite(fits.maps).all()
    with pytest.raises(UsageError, match="does not fit the decoder"):
        ex.explain_caption(x, method="cross", caption=[[5] * (n + 1), [6]])
    generated = ex.explain_caption(x, method="cross", max_len=n + 8)  # at most n words
    assert generated.maps.shape[1] <= n and torch.isfinite(generated.maps).all()



def test_images_of_any_size_are_preprocessed_to_the_encoders_size():
    torch.manual_seed(0)
    row = _ROWS["nn.TransformerDecoder over timm ViT"]
    model = row.build().eval()
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (37, 51, 3), dtype=np.uint8), rng.integers(0, 256, (90, 20, 3), dtype=np.uint8)]
    e = vx.Explainer(model).explain_caption(images, method="cross", caption=[[3], [4, 5]])
    assert e.input_size == row.size  # the ViT's img_size, not timm's 224 default
    assert e.maps.shape[:2] == (2, 2) and torch.isfinite(e.maps).all()


def test_token_ids_as_tensor_or_numpy_equal_the_same_ids_as_lists():
    torch.manual_seed(0)
    model = _ROWS["nn.TransformerDecoder over timm ViT"].build().eval()
    ex = vx.Explainer(model)
    x = torch.randn(2, 3, 32, 32)
    want = ex.explain_caption(x, method="cross", caption=[[3, 4], [5, 6]])
    for given in (torch.tensor([[3, 4], [5, 6]]), np.array([[3, 4], [5, 6]]), [np.int64(3), np.int64(4)]):
        got = ex.explain_caption(x, method="cross", caption=given)
        rows_ = [[3, 4], [3, 4]] if isinstance(given, list) else [[3, 4], [5, 6]]
        assert got.ids[:, :2].tolist() == rows_
        if not isinstance(given, list):
            torch.testing.assert_close(got.maps, want.maps)
    with pytest.raises(UsageError, match="outside the vocabulary"):
        ex.explain_caption(x, method="cross", caption=torch.tensor([[3, 99], [5, 6]]))
    with pytest.raises(UsageError, match="caption must be a string or a list"):  # (was a raw TypeError)
        ex.explain_caption(x, method="cross", caption=7)
    with pytest.raises(UsageError, match="got 3 captions for 2 images"):
        ex.explain_caption(x, method="cross", caption=[[3], [4], [5]])


def test_a_training_mode_captioner_is_left_as_found_and_warned_about():
    model = vx.zoo.load("shapes-sat").train()  # its CNN encoder has batch norm
    before = {k: v.clone() for k, v in model.named_buffers()}
    assert any("running_mean" in k for k in before)
    with pytest.warns(UserWarning, match="training mode"):
        vx.Explainer(model).explain_caption(torch.randn(2, 3, 64, 64), method="cross_generic", caption="red circle")
    assert model.training
    for k, v in model.named_buffers():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("name,method", [("shapes-sat", "cross_generic"), ("shapes-vit", "rollout")])
def test_images_given_to_a_float64_model_are_preprocessed_in_its_dtype(name, method):
    from vitexplain.data.images import preprocess

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (50, 70, 3), dtype=np.uint8), rng.integers(0, 256, (64, 40, 3), dtype=np.uint8)]
    model = vx.zoo.load(name).eval().double()
    ex = vx.Explainer(model)
    x, _ = preprocess(arrays, **ex.adapter.preprocess_kwargs())  # float32, as for a float32 model
    run = (lambda imgs: ex.explain_caption(imgs, method=method, caption="red circle")) if name == "shapes-sat" \
        else (lambda imgs: ex.explain(imgs, method=method, target=1))
    want = run(x.double()).maps
    got = run(arrays).maps
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["nn.TransformerDecoder over timm ViT", "HF VisionEncoderDecoder (ViT + GPT-2)", "HF BLIP"])
@pytest.mark.parametrize("caption", [None, [[3, 4], [5]]], ids=["generated", "given"])
def test_a_tensor_of_another_size_is_an_input_error(name, caption):
    from vitexplain.errors import InputError

    torch.manual_seed(0)
    model = _ROWS[name].build().eval()
    h, w = _ROWS[name].size
    with pytest.raises(InputError, match=f"expects {h}x{w}"):
        vx.Explainer(model).explain_caption(torch.randn(2, 3, h + 16, w + 16), method="cross_generic", caption=caption,
                                            max_len=3)


def test_upsample_puts_a_padded_encoders_cells_on_their_own_pixels():
    from timm.models.vision_transformer import VisionTransformer

    from vitexplain.adapters.captioning import TransformerDecoderCaptioner

    torch.manual_seed(0)
    encoder = VisionTransformer(img_size=32, patch_size=16, embed_dim=32, depth=2, num_heads=2, num_classes=0,
                                dynamic_img_size=True, dynamic_img_pad=True)
    model = TransformerDecoderCaptioner(encoder, vocab_size=20, dim=32, depth=2, heads=2, max_len=8).eval()
    e = vx.Explainer(model).explain_caption(torch.randn(1, 3, 50, 70), method="cross", caption=[[3, 4]])
    assert tuple(e.maps.shape[-2:]) == (4, 5)  # a 50 x 70 input padded to 64 x 80: 4 x 5 cells of 16 px
    e.maps.zero_()
    e.maps[0, 0, :, -1] = 1.0  # the last column of cells: padded pixels 64..79, i.e. input columns 64..69
    e.maps[0, 1, 0, :] = 1.0  # the first row of cells: input rows 0..15
    up = e.upsample()
    assert up.shape == (1, 2, 50, 70)
    # bilinear: above one half on the cell's own 16 px (its centre +- 8 px), below it elsewhere
    assert (up[0, 0].amax(0) > 0.5).nonzero().flatten().tolist() == list(range(64, 70))
    assert (up[0, 1].amax(1) > 0.5).nonzero().flatten().tolist() == list(range(0, 16))


def test_caption_figure_of_a_padded_encoder_matches_its_upsampled_maps():
    from timm.models.vision_transformer import VisionTransformer

    from vitexplain.adapters.captioning import TransformerDecoderCaptioner
    from vitexplain.viz.caption import caption_figure

    torch.manual_seed(0)
    encoder = VisionTransformer(img_size=32, patch_size=16, embed_dim=32, depth=2, num_heads=2, num_classes=0,
                                dynamic_img_size=True, dynamic_img_pad=True)
    model = TransformerDecoderCaptioner(encoder, vocab_size=20, dim=32, depth=2, heads=2, max_len=8).eval()
    image = np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    e = vx.Explainer(model).explain_caption(torch.randn(1, 3, 50, 70), method="cross", caption=[[3, 4]])
    # the oracle: the figure of maps already on the image's pixels (upsample is checked above)
    want = caption_figure(image, e.tokens[0], e.upsample((50, 70))[0])
    np.testing.assert_array_equal(e.figure(0, image=image), want)


def test_caption_gradients_run_inside_no_grad_and_are_refused_clearly_inside_inference_mode():
    """Per-word maps that take gradients (cross_generic, attnlrp) equal, under the caller's torch.no_grad(), those
    explained outside it (the method's backward used to fail: 'not part of an autograd graph'); inside
    torch.inference_mode() a UsageError says to call it outside; gradient-free methods still run there."""
    ex = vx.Explainer(vx.zoo.load("shapes-captioner"))
    images = list(vx.data.shapes(2, seed=4).images)
    want = ex.explain_caption(images, method=["cross", "cross_generic"], caption="red circle")
    with torch.no_grad():
        got = ex.explain_caption(images, method=["cross", "cross_generic"], caption="red circle")
    for a, b in zip(got, want):
        torch.testing.assert_close(a.maps, b.maps)
    with torch.inference_mode(), pytest.raises(UsageError, match=r"cross_generic take\(s\) gradients.*inference_mode"):
        ex.explain_caption(images, method=["cross", "cross_generic"], caption="red circle")
    with torch.inference_mode():
        torch.testing.assert_close(ex.explain_caption(images, method="cross", caption="red circle").maps, want[0].maps)


def test_a_caption_that_encodes_to_no_token_says_so_not_that_it_is_empty():
    # a tokenizer that drops every character of a caption (a normaliser that strips it) gave "caption 0 is empty"
    # for the text "red": the message now names the caption and the tokenizer as the cause
    import pytest

    from vitexplain.targets import given_token_ids

    with pytest.raises(vx.UsageError, match=r"caption 0 \('red'\) encodes to no token with this tokenizer"):
        given_token_ids("red", 2, lambda text: [], vocab=None)
    with pytest.raises(vx.UsageError, match=r"caption 1 is empty"):
        given_token_ids(["red", "  "], 2, lambda text: [1] if text.strip() else [], vocab=None)
