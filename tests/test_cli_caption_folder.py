"""`vitexplain caption --model DIR` with a Hugging Face encoder-decoder captioner saved with ``save_pretrained``:
a VisionEncoderDecoder (ViT + GPT-2) with its tokenizer and image processor saved beside it, and BLIP with its whole
``BlipProcessor``.

Expectation (independent of the CLI's loading): transformers loads the folder itself, the Hugging Face image
processor computes ``pixel_values`` of each image, and ``Explainer.explain_caption`` on those pixels with the
folder's tokenizer gives the same caption, words and per-word maps the CLI wrote. The image processors use
statistics other than the model type's defaults, so a CLI that ignored the folder's processor would differ; the
images are 32 px, the models' input size, so no resize enters.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitexplain as vx
from vitexplain import cli

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from support_table import _blip, _vision_encoder_decoder  # noqa: E402
from vlm_helpers import tokenizer  # noqa: E402

MEAN, STD = [0.3, 0.4, 0.5], [0.2, 0.25, 0.3]  # neither the ViT default (0.5) nor BLIP's (CLIP statistics)
METHODS = ["cross", "cross_generic"]


def _ved(folder: Path) -> None:
    torch.manual_seed(0)
    model = _vision_encoder_decoder().eval()
    with torch.no_grad():  # a random GPT-2 repeats its start token: make the words differ
        model.decoder.lm_head.weight.normal_(0, 1.0)
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=MEAN, image_std=STD).save_pretrained(folder)


def _blip_folder(folder: Path) -> None:
    torch.manual_seed(0)
    model = _blip().eval()
    model.save_pretrained(folder)
    image_processor = transformers.BlipImageProcessor(size={"height": 32, "width": 32}, image_mean=MEAN, image_std=STD)
    transformers.BlipProcessor(image_processor=image_processor, tokenizer=tokenizer()).save_pretrained(folder)


def _reference(folder: Path, paths: list[Path]):
    """transformers' own loading, the folder's image processor on each image, the API."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True).eval()
    image_processor = transformers.AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    words = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    pixels = image_processor(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt").pixel_values
    return vx.Explainer(model, tokenizer=words).explain_caption(pixels, method=METHODS, max_len=4)


@pytest.mark.parametrize("build", [_ved, _blip_folder], ids=["vision-encoder-decoder", "blip"])
def test_caption_with_a_captioner_folder_equals_the_api_on_the_folders_own_processor(build, tmp_path: Path) -> None:
    folder, images, out = tmp_path / "model", tmp_path / "images", tmp_path / "out"
    build(folder)
    images.mkdir()
    rng = np.random.default_rng(5)
    keys = ["a.png", "b.png"]
    for key in keys:
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(images / key)
    assert cli.main(["caption", str(images), "--out", str(out), "--model", str(folder), "--max-len", "4",
                     "--method", ",".join(METHODS), "-q", "-j", "0"]) == 0
    expected = _reference(folder, [images / k for k in keys])
    records = {r["key"]: r for r in map(json.loads, (out / "manifest.jsonl").read_text(encoding="utf-8").splitlines())}
    for i, key in enumerate(keys):
        rec = records[key]
        tokens = expected[0].tokens[i]
        assert rec["status"] == "ok" and tokens, rec
        assert rec["tokens"] == tokens and rec["caption"] == expected[0].captions[i]
        assert not any(t.isdigit() for t in tokens)  # words named by the folder's tokenizer, not token ids
        for e in expected:
            with np.load(out / f"{key}.{e.method}.npz") as z:
                np.testing.assert_allclose(z["maps"], e.maps[i, :len(tokens)].numpy(), rtol=1e-4, atol=1e-6)


def test_a_captioner_folder_without_its_tokenizer_says_to_save_it(tmp_path: Path, capsys) -> None:
    folder, images = tmp_path / "model", tmp_path / "images"
    _vision_encoder_decoder().save_pretrained(folder)  # no tokenizer, no processor
    images.mkdir()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(images / "a.png")
    assert cli.main(["caption", str(images), "--out", str(tmp_path / "out"), "--model", str(folder), "-q"]) == 2
    err = capsys.readouterr().err
    assert "saved without its tokenizer" in err and "tokenizer.save_pretrained" in err


def test_a_vision_encoder_decoder_folder_without_its_image_processor_says_to_save_it(tmp_path: Path, capsys) -> None:
    """A VisionEncoderDecoder's pixel statistics belong to how it was trained (ViT-GPT2 and TrOCR use 0.5, a Swin or
    DeiT encoder fine-tuned with its own processor ImageNet's), not to its model type: without the image processor
    saved beside it, the run preprocessed every image with mean = std = 0.5 and bicubic resizing, silently."""
    folder, images = tmp_path / "model", tmp_path / "images"
    _vision_encoder_decoder().save_pretrained(folder)
    tokenizer().save_pretrained(folder)  # the tokenizer, but no preprocessor_config.json
    images.mkdir()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(images / "a.png")
    assert cli.main(["caption", str(images), "--out", str(tmp_path / "out"), "--model", str(folder), "-q"]) == 2
    err = capsys.readouterr().err
    assert "without its image processor" in err and "save_pretrained" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
