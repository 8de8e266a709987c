"""`vitexplain export --model DIR` with a Hugging Face image classifier saved with ``save_pretrained``.

Expectation: the CLI's saved maps and predictions equal what the Python API gives for the same image
and the model loaded from the same folder by transformers itself.
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


def _vit():
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8, num_labels=4,
                                    id2label={0: "zero", 1: "one", 2: "two", 3: "three"})
    return transformers.ViTForImageClassification(config), "rollout,cdam"


def _resnet():
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1],
                                       num_labels=4)
    return transformers.ResNetForImageClassification(config), "gradcam"


@pytest.mark.parametrize("build", [_vit, _resnet])
def test_export_with_a_classifier_folder_equals_the_api(build, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, methods = build()
    with torch.no_grad():
        head = [m for m in model.classifier.modules() if isinstance(m, torch.nn.Linear)][-1]
        head.weight.normal_(0, 1.0)  # random heads are near zero: make the classes differ
    folder, images, out = tmp_path / "model", tmp_path / "images", tmp_path / "out"
    model.save_pretrained(folder)
    images.mkdir()
    rng = np.random.default_rng(3)
    for name in ("a.png", "b.png"):
        Image.fromarray(rng.integers(0, 255, (70, 90, 3), dtype=np.uint8)).save(images / name)
    assert cli.main(["export", str(images), "--out", str(out), "--model", str(folder), "--method", methods,
                     "--save-maps", "-q", "-j", "0"]) == 0
    records = {r["key"]: r for r in map(json.loads, (out / "manifest.jsonl").read_text(encoding="utf-8").splitlines())}
    reference = type(model).from_pretrained(folder, local_files_only=True).eval()  # transformers' own loading
    ex = vx.Explainer(reference)
    for name in ("a.png", "b.png"):
        record = records[name]
        assert record["status"] == "ok"
        for method in methods.split(","):
            e = ex.explain([str(images / name)], method=method)
            assert record["target"]["index"] == int(e.targets[0])
            assert record["target"]["label"] == (model.config.id2label[int(e.targets[0])] if build is _vit else None)
            np.testing.assert_allclose(np.load(out / f"{name}.{method}.npy"), e.maps[0].numpy(), rtol=1e-4, atol=1e-6)


def test_a_folder_that_is_neither_a_classifier_nor_a_vlm_is_a_usage_error(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "bert"
    transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                   intermediate_size=64)).save_pretrained(folder)
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(image)
    assert cli.main(["export", str(image), "--out", str(tmp_path / "out"), "--model", str(folder), "-q"]) == 2
    assert "neither an image classifier nor a vision-language" in capsys.readouterr().err


def test_a_backbone_folder_is_refused_not_given_a_random_classifier(tmp_path: Path, capsys) -> None:
    """A ViTModel saved in the folder loads as ViTForImageClassification with a classifier transformers makes up
    at random (its weights are missing): the export refuses it, writing nothing."""
    folder = tmp_path / "backbone"
    transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                 intermediate_size=64, image_size=32, patch_size=8)).save_pretrained(folder)
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "out"
    assert cli.main(["export", str(image), "--out", str(out), "--model", str(folder), "-q"]) == 2
    err = capsys.readouterr().err
    assert "classifier.weight" in err and "ViTModel" in err and "at random" in err
    assert not out.exists()


def _mobilevit():
    config = transformers.MobileViTConfig(image_size=64, hidden_sizes=[32, 40, 48], num_labels=4,
                                          neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64])
    return transformers.MobileViTForImageClassification(config), "gradcam,layercam"


def _efficientnet():
    config = transformers.EfficientNetConfig(image_size=64, depth_coefficient=0.5, num_labels=4)
    return transformers.EfficientNetForImageClassification(config), "gradcam,layercam"


TIMM_CFG = dict(input_size=(3, 48, 48), mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4), crop_pct=1.0,
                interpolation="bilinear")  # a timm hub tag's data config, not the architecture's default


def _timm_wrapper():
    config = transformers.TimmWrapperConfig(architecture="resnet18", num_labels=4, pretrained_cfg=dict(TIMM_CFG))
    return transformers.TimmWrapperForImageClassification(config), "gradcam"


PROCESSORS = {  # a model, and the image processor saved with it (its output size: the images' size)
    "vit_imagenet_stats": (_vit, lambda: transformers.ViTImageProcessor(
        image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225], size={"height": 32, "width": 32}), 32),
    "mobilevit_bgr_unnormalised": (_mobilevit, lambda: transformers.MobileViTImageProcessor(
        size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}), 64),
    "efficientnet_include_top": (_efficientnet, lambda: transformers.EfficientNetImageProcessor(
        size={"height": 64, "width": 64}, crop_size={"height": 64, "width": 64}), 64),
    "timm_wrapper_data_config": (_timm_wrapper, lambda: transformers.TimmWrapperImageProcessor(
        pretrained_cfg=dict(TIMM_CFG), architecture="resnet18"), 48),
}


@pytest.mark.parametrize("case", list(PROCESSORS))
def test_export_preprocesses_with_the_image_processor_saved_in_the_folder(case, tmp_path: Path) -> None:
    """A folder that holds the model's image processor (preprocessor_config.json) is preprocessed as that processor
    does: ImageNet mean and std where the ViT type's default is 0.5; MobileViT's pixels in [0, 1] with the channels
    flipped to BGR; EfficientNet's second division by the std (include_top); a wrapped timm model's data config
    (TimmWrapperImageProcessor). The CLI's maps equal the API's on the
    processor's own pixel_values (images at the processor's output size: no resampling). They were preprocessed
    with the model type's defaults, silently explaining another input than the model's."""
    build, make_processor, size = PROCESSORS[case]
    torch.manual_seed(0)
    model, methods = build()
    with torch.no_grad():
        for module in model.modules():  # He-scaled convs: a random init's std-0.02 convs lose the image (zero maps)
            if isinstance(module, torch.nn.Conv2d):
                module.weight.normal_(0.0, (2.0 / module.weight[0].numel()) ** 0.5)
        head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
        head.weight.normal_(0, 1.0)
    folder, images, out = tmp_path / "model", tmp_path / "images", tmp_path / "out"
    model.save_pretrained(folder)
    make_processor().save_pretrained(folder)
    images.mkdir()
    rng = np.random.default_rng(4)
    arrays = {name: rng.integers(0, 255, (size, size, 3), dtype=np.uint8) for name in ("a.png", "b.png")}
    for name, array in arrays.items():
        Image.fromarray(array).save(images / name)
    assert cli.main(["export", str(images), "--out", str(out), "--model", str(folder), "--method", methods,
                     "--save-maps", "-q", "-j", "0"]) == 0
    reference = type(model).from_pretrained(folder, local_files_only=True).eval()
    ex = vx.Explainer(reference)
    pixels = transformers.AutoImageProcessor.from_pretrained(folder, local_files_only=True)(
        [arrays[name] for name in ("a.png", "b.png")], return_tensors="pt").pixel_values
    for method in methods.split(","):
        e = ex.explain(pixels, method=method)
        assert float(e.maps.abs().max()) > 0
        for i, name in enumerate(("a.png", "b.png")):
            np.testing.assert_allclose(np.load(out / f"{name}.{method}.npy"), e.maps[i].numpy(), rtol=1e-4,
                                       atol=1e-5 * float(e.maps.abs().max()))
