"""Hugging Face CNN classifiers (ResNet, ConvNeXt, RegNet, BiT, EfficientNet, MobileNet, MobileViT): the Grad-CAM family.

Oracle: a forward hook on the last stage of the model's own forward (``pixel_values=`` in, ``logits`` out)
and ``torch.autograd.grad``, then the Grad-CAM / LayerCAM formulas written here (as in tests/test_cnn.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitexplain as vx

transformers = pytest.importorskip("transformers")

SIZE = (96, 112)  # not square, not the configs' 224: feature maps of 3 x 4 at stride 32


def _resnet():
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_labels=5))


def _convnext():
    return transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_labels=5))


def _regnet():
    return transformers.RegNetForImageClassification(transformers.RegNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], groups_width=8, num_labels=5))


def _bit():
    return transformers.BitForImageClassification(transformers.BitConfig(
        embedding_size=32, hidden_sizes=[32, 64, 96, 128], depths=[1, 1, 1, 1], num_groups=8, num_labels=5))


def _efficientnet():
    return transformers.EfficientNetForImageClassification(transformers.EfficientNetConfig(
        image_size=96, depth_coefficient=0.5, num_labels=5))


def _mobilenet_v2():
    return transformers.MobileNetV2ForImageClassification(transformers.MobileNetV2Config(
        image_size=96, depth_multiplier=0.35, num_labels=5))


def _mobilevit():  # a conv/attention hybrid: the Grad-CAM family on its last conv feature map
    return transformers.MobileViTForImageClassification(transformers.MobileViTConfig(
        image_size=96, hidden_sizes=[32, 40, 48], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], num_labels=5))


# name: (build, the last stage's module name)
CASES = {
    "resnet": (_resnet, "resnet.encoder.stages.3"),
    "convnext": (_convnext, "convnext.encoder.stages.3"),
    "regnet": (_regnet, "regnet.encoder.stages.3"),
    "bit": (_bit, "bit.encoder.stages.3"),
    "efficientnet": (_efficientnet, None),
    "mobilenet_v2": (_mobilenet_v2, None),
    "mobilevit": (_mobilevit, "mobilevit.encoder.layer.4"),
}


def _build(name):
    torch.manual_seed(0)
    model = CASES[name][0]().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():  # random init leaves norms at identity, heads near zero, convs small
            if isinstance(module, torch.nn.Conv2d):  # (MobileViT's std-0.02 convs lose the image by its last stage)
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, (2.0 / fan_in) ** 0.5, generator=generator)
            if isinstance(module, (torch.nn.BatchNorm2d, torch.nn.LayerNorm, torch.nn.GroupNorm)) and module.weight is not None:
                module.weight.normal_(1.0, 0.3, generator=generator)
                module.bias.normal_(0.0, 0.3, generator=generator)
        head = [m for m in model.classifier.modules() if isinstance(m, torch.nn.Linear)][-1]
        head.weight.normal_(0.0, 1.0, generator=generator)
    return model


def _oracle(model, layer, x, classes):
    store = {}
    handle = model.get_submodule(layer).register_forward_hook(lambda m, i, o: store.__setitem__("a", o))
    try:
        logits = model(pixel_values=x).logits
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(logits[torch.arange(len(x)), classes].sum(), store["a"])
    a, g = store["a"].detach().double().numpy(), grad.double().numpy()
    gradcam = np.maximum((g.mean(axis=(2, 3))[:, :, None, None] * a).sum(1), 0)
    layercam = np.maximum((np.maximum(g, 0) * a).sum(1), 0)
    return gradcam, layercam


@pytest.mark.parametrize("name", list(CASES))
def test_grad_cam_family_equals_the_formulas_on_the_models_own_forward(name):
    model = _build(name)
    ex = vx.Explainer(model)
    layer = CASES[name][1] or ex.adapter.target_layer
    assert ex.adapter.target_layer == layer and ex.adapter.stages[-1] == layer
    assert {"gradcam", "gradcam++", "layercam"} <= set(ex.methods())
    x = torch.randn(3, 3, *SIZE, generator=torch.Generator().manual_seed(2))
    classes = torch.tensor([0, 3, 4])
    results = {e.method: e for e in ex.explain(x, method=["gradcam", "layercam"], target=classes)}
    gradcam, layercam = _oracle(model, layer, x, classes)
    for method, expected in (("gradcam", gradcam), ("layercam", layercam)):
        maps = results[method].maps
        assert maps.shape == expected.shape and float(np.abs(expected).max()) > 0
        np.testing.assert_allclose(maps.double().numpy(), expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    one = ex.explain(x[1:2], method="gradcam", target=classes[1:2]).maps
    # a batch's convolutions sum in another order than one image's: measured up to 2.3e-6 of the map's max with two
    # torch threads (0 to 6.6e-7 with one); tolerance 1e-5 of the max, ~4x that
    scale = float(results["gradcam"].maps[1].abs().max())
    torch.testing.assert_close(one[0], results["gradcam"].maps[1], rtol=0, atol=1e-5 * scale)


def test_images_are_preprocessed_to_the_configured_size_and_labels_come_from_id2label():
    model = _build("mobilenet_v2")
    model.config.id2label = {i: f"class {i}" for i in range(5)}
    ex = vx.Explainer(model)
    assert ex.adapter.preprocess_kwargs()["input_size"] == (96, 96)
    images = [np.random.default_rng(0).integers(0, 255, (50, 70, 3), dtype=np.uint8)]
    e = ex.explain(images, method="gradcam", target="class 2")
    assert e.targets.tolist() == [2] and torch.isfinite(e.maps).all()


def test_hugging_face_models_no_adapter_describes_are_refused_with_a_clear_error():
    """A CNN of a type without a stage path (PoolFormer), and a headless CNN backbone: refused, not run."""
    poolformer = transformers.PoolFormerForImageClassification(transformers.PoolFormerConfig(
        hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_labels=5))
    headless = transformers.ResNetModel(transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 48, 64],
                                                                  depths=[1, 1, 1, 1]))
    for model in (poolformer, headless):
        with pytest.raises(vx.UnsupportedModelError, match="does not know how to explain"):
            vx.Explainer(model)


def _se_oracle(module, x):
    """The channel gate of a Hugging Face squeeze-excitation layer, written out from its submodules."""
    pooled = x.mean((2, 3), keepdim=True)
    if hasattr(module, "act_expand"):  # EfficientNetSqueezeExciteLayer
        return torch.sigmoid(module.expand(module.act_reduce(module.reduce(pooled))))[:, :, 0, 0]
    first, relu, second, _ = module.attention  # RegNetSELayer
    return torch.sigmoid(second(relu(first(pooled))))[:, :, 0, 0]


@pytest.mark.parametrize("name", ["efficientnet", "regnety"])
def test_squeeze_excitation_gates_equal_their_formula_and_are_what_the_layer_multiplied_by(name):
    model = _build("efficientnet") if name == "efficientnet" else transformers.RegNetForImageClassification(
        transformers.RegNetConfig(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1],
                                  groups_width=8, layer_type="y", num_labels=5)).eval()
    assert "channel" in vx.Explainer(model).methods()
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(4))
    outputs = {}
    handles = [m.register_forward_hook(lambda mod, i, o, n=n: outputs.__setitem__(n, o))
               for n, m in model.named_modules() if type(m).__name__ in ("EfficientNetSqueezeExciteLayer", "RegNetSELayer")]
    with torch.no_grad(), vx.capture(model, gates=True, attention=False) as rec:
        model(pixel_values=x)
    for h in handles:
        h.remove()
    assert [r.name for r in rec.gates] == list(outputs)  # one record per layer call, in call order
    for r in rec.gates:
        module = model.get_submodule(r.name)
        torch.testing.assert_close(r.channel, _se_oracle(module, r.input), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(outputs[r.name], r.input * r.channel[:, :, None, None], rtol=1e-5, atol=1e-6)
    assert any(float(r.channel.std()) > 1e-3 for r in rec.gates)


def test_mobilevit_images_are_preprocessed_as_its_image_processor_does():
    """MobileViT's image processor gives pixels in [0, 1], unnormalised, with the channels flipped to BGR; images were
    normalised with ImageNet statistics in RGB order, so Grad-CAM explained another input than the model's. An image
    at the model's size (nothing resampled): the maps equal those on the processor's own pixel_values."""
    model = _build("mobilevit")
    ex = vx.Explainer(model)
    image = np.random.default_rng(5).integers(0, 255, (96, 96, 3), dtype=np.uint8)
    image[:, :48, 0] = 255  # channels that differ, so their order matters
    processor = transformers.MobileViTImageProcessor(do_resize=False, do_center_crop=False)
    pixels = processor([image], return_tensors="pt").pixel_values
    x = ex.preprocess([image], crop=False)[0]  # resized to its own size: nothing resampled
    torch.testing.assert_close(x, pixels, rtol=0, atol=1e-6)
    for method in ("gradcam", "layercam"):
        want = ex.explain(pixels, method=method, target=1).maps
        assert float(want.abs().max()) > 0
        torch.testing.assert_close(ex.explain(x, method=method, target=1).maps, want)


@pytest.mark.parametrize("name", ["mobilenet_v2", "mobilenet_v1", "efficientnet", "bit", "mobilevit"])
def test_images_are_preprocessed_as_the_converted_checkpoints_processors_do(name):
    """The image processors transformers' conversion scripts saved with its MobileNets (shortest edge to size + 32,
    a center crop, bilinear, mean and std 0.5), EfficientNets (resized to the size, ImageNet mean, the std
    0.4785... divided in twice by include_top) and BiT (timm's BiT data config: mean and std 0.5, crop_pct 1,
    bilinear) and MobileViTs (shortest edge to size + 32, a center crop): MobileNet and BiT images got ImageNet
    statistics, MobileViT's a 0.875 crop. On an image the processor resizes to its own size (nothing resampled) the
    preprocessed images equal the processor's."""
    if name == "mobilenet_v1":
        model = transformers.MobileNetV1ForImageClassification(transformers.MobileNetV1Config(
            image_size=96, depth_multiplier=0.25, num_labels=5)).eval()
    else:
        model = _build(name)
    ex = vx.Explainer(model)
    size = ex.adapter.preprocess_kwargs()["input_size"][0]
    if name == "efficientnet":
        processor = transformers.EfficientNetImageProcessor(
            size={"height": size, "width": size}, image_mean=[0.485, 0.456, 0.406],
            image_std=[0.47853944, 0.4732864, 0.47434163], do_center_crop=False)
        side = size
    elif name == "bit":
        processor = transformers.BitImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                                   resample=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        side = size
    elif name == "mobilevit":
        processor = transformers.MobileViTImageProcessor(crop_size=size, size=size + 32)
        side = size + 32
    else:
        cls = transformers.MobileNetV1ImageProcessor if name == "mobilenet_v1" else transformers.MobileNetV2ImageProcessor
        processor = cls(crop_size={"width": size, "height": size}, size={"shortest_edge": size + 32})
        side = size + 32
    image = np.random.default_rng(6).integers(0, 255, (side, side, 3), dtype=np.uint8)
    x = ex.preprocess([image])[0]
    torch.testing.assert_close(x, processor([image], return_tensors="pt").pixel_values, rtol=0, atol=1e-4)


def test_a_plain_conv_net_with_a_classifier_attribute_and_no_config_is_still_a_cnn():
    """The Hugging Face detector reads ``config.model_type``: a user's conv net named like HF's (``self.classifier``)
    but without a config is left to the generic CNN adapter (it raised a raw AttributeError)."""
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, 2), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, 2))
            self.pool = torch.nn.AdaptiveAvgPool2d(1)
            self.classifier = torch.nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.classifier(self.pool(self.features(x)).flatten(1))

    ex = vx.Explainer(Net().eval())
    assert ex.family == "cnn" and type(ex.adapter).__name__ == "CNNAdapter"
    maps = ex.explain(torch.randn(2, 3, 32, 32), method="gradcam", target=1).maps
    assert maps.shape[0] == 2 and torch.isfinite(maps).all()
