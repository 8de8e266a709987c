"""A Hugging Face VisionEncoderDecoder captioner's pixel statistics come from its image processor, never from a guess.

Its statistics depend on how it was trained (0.5 for ViT-GPT2 and TrOCR, ImageNet's for an encoder fine-tuned with
its own processor), not on its model type. Images given to ``explain_caption`` as files, PIL images or arrays were
preprocessed with a guessed mean = std = 0.5 and bicubic resizing, silently. Now they are preprocessed as the image
processor given with ``processor=`` does (or the one saved with a model folder, ``--model DIR``), and without one
they are refused with what to pass; pixels the user preprocessed (tensors) work as before. BLIP keeps its model
type's (CLIP) statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitexplain as vx
from support_table import rows

transformers = pytest.importorskip("transformers")
_ROWS = {r.name: r for r in rows() if r.group == "captioner"}
VED = "HF VisionEncoderDecoder (ViT + GPT-2)"
IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def _images(size: int = 32, n: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _ROWS[VED].build().eval()


def test_images_without_an_image_processor_are_refused_with_what_to_pass() -> None:
    model = _model()
    with pytest.raises(vx.UsageError, match=r"image processor.*processor=.*pixel_values"):
        vx.Explainer(model).explain_caption(_images(), method="cross", caption=[[3, 4], [5]])
    with pytest.raises(vx.UsageError, match="image processor"):
        vx.Explainer(model).preprocess(_images())
    # pixels preprocessed by the user are explained as before
    e = vx.Explainer(model).explain_caption(torch.randn(2, 3, 32, 32), method="cross", caption=[[3, 4], [5]])
    assert e.maps.shape[:2] == (2, 2) and torch.isfinite(e.maps).all()


@pytest.mark.parametrize("stats", [([0.5] * 3, [0.5] * 3), IMAGENET], ids=["half", "imagenet"])
def test_images_are_preprocessed_as_the_given_image_processor_does(stats) -> None:
    """The oracle is the processor itself: its pixel_values, explained as a tensor, give the same maps."""
    model = _model()
    proc = transformers.ViTImageProcessor(image_mean=stats[0], image_std=stats[1], size={"height": 32, "width": 32})
    images = _images()
    want_x = proc(images, return_tensors="pt").pixel_values
    for given in (proc, transformers.TrOCRProcessor(image_processor=proc, tokenizer=_gpt2_tokenizer())):
        ex = vx.Explainer(model, processor=given)
        x, regions, _, _ = ex.preprocess(images)
        torch.testing.assert_close(x, want_x, rtol=0, atol=1e-5)
        got = ex.explain_caption(images, method="cross", caption=[[3, 4], [5]])
        want = vx.Explainer(model).explain_caption(want_x, method="cross", caption=[[3, 4], [5]])
        torch.testing.assert_close(got.maps, want.maps)
        assert np.array_equal(regions[0], images[0])


def _gpt2_tokenizer():
    """A tiny GPT-2 tokenizer built offline (vocabulary of the bytes a..z)."""
    import json
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return transformers.GPT2Tokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), unk_token="a")


def test_a_model_folders_saved_processor_is_used_as_before() -> None:
    model = _model()
    model.vx_preprocess = dict(mean=tuple(IMAGENET[0]), std=tuple(IMAGENET[1]))  # what --model DIR sets
    x, _, _, _ = vx.Explainer(model).preprocess(_images())
    proc = transformers.ViTImageProcessor(image_mean=IMAGENET[0], image_std=IMAGENET[1],
                                          size={"height": 32, "width": 32})
    torch.testing.assert_close(x, proc(_images(), return_tensors="pt").pixel_values, rtol=0, atol=1e-5)


def test_what_processor_takes_for_a_captioner() -> None:
    model = _model()
    with pytest.raises(vx.UsageError, match="image processor"):
        vx.Explainer(model, processor="ViTImageProcessor")
    proc = transformers.ViTImageProcessor(size={"height": 32, "width": 32})
    with pytest.raises(vx.UsageError, match="processor_kwargs="):
        vx.Explainer(model, processor=proc, processor_kwargs={"do_resize": False})


def test_blip_keeps_its_model_types_statistics() -> None:
    torch.manual_seed(0)
    e = vx.Explainer(_ROWS["HF BLIP"].build().eval()).explain_caption(_images(), method="cross", caption=[[3, 4], [5]])
    assert torch.isfinite(e.maps).all()


@pytest.mark.parametrize("name", ["HF BLIP", "HF GIT"])
def test_blip_and_git_take_an_image_processor_too(name) -> None:
    """Their model type's statistics are the default; a processor given with processor= replaces them."""
    torch.manual_seed(0)
    row = _ROWS[name]
    model = row.build().eval()
    images = _images(row.size[0])
    proc = transformers.ViTImageProcessor(image_mean=IMAGENET[0], image_std=IMAGENET[1],
                                          size={"height": row.size[0], "width": row.size[1]})
    default = vx.Explainer(model).preprocess(images)[0]
    x = vx.Explainer(model, processor=proc).preprocess(images)[0]
    want = proc(images, return_tensors="pt").pixel_values
    torch.testing.assert_close(x, want, rtol=0, atol=1e-5)
    assert (default - want).abs().max() > 0.1


def test_a_processor_holding_a_tokenizer_gives_it_too() -> None:
    """``processor=TrOCRProcessor(...)`` set only the pixels: a caption given as text then had no tokenizer. Its
    tokenizer is now taken as ``tokenizer=`` would be (and an explicit ``tokenizer=`` still wins)."""
    model = _model()
    proc = transformers.ViTImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3, size={"height": 32, "width": 32})
    tok = _gpt2_tokenizer()
    images = _images()
    got = vx.Explainer(model, processor=transformers.TrOCRProcessor(image_processor=proc, tokenizer=tok)
                       ).explain_caption(images, method="cross", caption="abc")
    want = vx.Explainer(model, processor=proc, tokenizer=tok).explain_caption(images, method="cross", caption="abc")
    assert got.tokens == want.tokens and len(got.tokens[0]) > 0 and torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.maps, want.maps)
    other = _gpt2_tokenizer()
    ex = vx.Explainer(model, processor=transformers.TrOCRProcessor(image_processor=proc, tokenizer=tok), tokenizer=other)
    assert ex.adapter.tokenizer is other

