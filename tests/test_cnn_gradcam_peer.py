"""The Grad-CAM family equals pytorch-grad-cam (grad-cam 1.5.7, the peer most users know) on CNNs
and layers tests/test_cnn.py does not use: timm EfficientNet, ConvNeXt and RegNet, torchvision
MobileNetV3 and ResNet, each at its default layer and at another module, on a non-square input;
and the ViT token Grad-CAM equals the peer's ViT recipe on registers, average pooling, a distilled
DeiT and EVA (3 x 5 grid).

The peer's maps are taken before its min-max scaling and resize (its ``get_cam_image`` on the
activations and gradients its own hooks recorded, after its own backward), then ReLU as it does.
Its Grad-CAM++ adds eps=1e-6 to the weights' denominator (../shared/references.md: it moves the
weights by 7-40% at small gradient scales); the Grad-CAM++ comparison scales the target score by
1e4 on both sides so that eps is negligible (alpha is not scale-invariant, so the scaled score
is what both explain), and both run in float64 (that denominator, 2 g^2 + sum(A) g^3, can nearly
cancel: in float32 the two differed by 1.5e-3). Floor: 1e-4 relative (max abs difference over the
peer's largest value); measured at most 4.3e-6 (Grad-CAM++ on ResNet-18's layer3; the package computes a
float64 model's maps in float64: 2.7e-5 when it cast them to float32 first), 4.6e-8 for Grad-CAM and LayerCAM.

Not compared: a layer whose output the model changes in place afterwards (DenseNet's
``features.norm5``; a ResNet block's ``bn2``): the peer keeps a reference to the changed tensor, so
its activations are the in-place result while its gradients are the module's;
tests/test_plan_fuzz.py checks those layers against a hand-written oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
import torchvision

import vitexplain as vx
from peers import require

require("pytorch_grad_cam", "pip install --no-deps grad-cam==1.5.7 ttach (test-only peer; .ci/run installs it)")

from pytorch_grad_cam import GradCAM, GradCAMPlusPlus, LayerCAM  # noqa: E402

from support_table import reinit_heads  # noqa: E402

PEERS = {"gradcam": GradCAM, "gradcam++": GradCAMPlusPlus, "layercam": LayerCAM}
SCALE = {"gradcam": 1.0, "gradcam++": 1e4, "layercam": 1.0}
RTOL = 1e-4

MODELS = {
    "timm efficientnet_b0": (lambda: timm.create_model("efficientnet_b0", num_classes=5), ("blocks.4", "conv_head")),
    "timm convnext_atto": (lambda: timm.create_model("convnext_atto", num_classes=5), ("stages.2",)),
    "timm regnetx_002": (lambda: timm.create_model("regnetx_002", num_classes=5), ("s3",)),
    "torchvision mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=5), ("features.9",)),
    "torchvision resnet18": (lambda: torchvision.models.resnet18(num_classes=5), ("layer3", "layer4.0.conv2")),
}


def _peer(model, layer, x, classes, method):
    """The peer's map of ``layer``: ReLU(its get_cam_image), before its scaling and resize."""
    cam = PEERS[method](model=model, target_layers=[model.get_submodule(layer)])
    try:
        outputs = cam.activations_and_grads(x)
        targets = [(lambda row, c=int(c): SCALE[method] * row[c]) for c in classes]
        model.zero_grad()
        sum(t(row) for t, row in zip(targets, outputs)).backward()
        (acts,), (grads,) = cam.activations_and_grads.activations, cam.activations_and_grads.gradients
        return np.maximum(cam.get_cam_image(x, None, targets, acts.numpy(), grads.numpy(), False), 0)
    finally:
        cam.activations_and_grads.release()
        model.zero_grad(set_to_none=True)


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    torch.manual_seed(6)
    build, layers = MODELS[request.param]
    model = build().eval()
    reinit_heads(model)
    model.double()  # both sides in float64: Grad-CAM++'s denominator 2 g^2 + sum(A) g^3 can nearly cancel
    x = torch.randn(3, 3, 64, 96, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with torch.no_grad():
        classes = model(x).argsort(1)[:, -2]  # the runner-up class: not the one the model predicts
    return model, x, classes, (None, *layers)


@pytest.mark.parametrize("method", list(PEERS))
def test_grad_cams_equal_pytorch_grad_cam(case, method):
    model, x, classes, layers = case
    ex = vx.Explainer(model)
    scale = SCALE[method]
    for layer in layers:
        options = {} if layer is None else {"module": layer}
        e = ex.explain(x, method=method, target=lambda out: scale * out[torch.arange(len(classes)), classes], **options)
        expected = _peer(model, layer or ex.adapter.target_layer, x, classes, method)
        got = e.maps.double().numpy()
        assert got.shape == expected.shape and expected.max() > 0, (layer, got.shape, expected.shape)
        np.testing.assert_allclose(got, expected, rtol=0, atol=RTOL * expected.max(), err_msg=f"{method} {layer}")


VIT_LAYOUTS = ["registers", "average pooling + registers", "DeiT distilled", "EVA rope + registers (average pooling)"]


@pytest.mark.parametrize("name", VIT_LAYOUTS)
def test_token_gradcam_equals_pytorch_grad_cam_on_vit_layouts(name):
    """The ViT ``gradcam`` is pytorch-grad-cam's recipe for ViTs (docs/methods.md): GradCAM on the last
    block's ``norm1`` with a reshape_transform that drops the prefix tokens (class, distillation,
    registers) and lays the patches on their grid; here on a 3 x 5 grid."""
    from test_layouts_oracle import MODELS, SIZE

    torch.manual_seed(8)
    model = MODELS[name][0]().eval().double()
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    classes = torch.tensor([1, 3])
    e = vx.Explainer(model).explain(x, method="gradcam", target=classes)
    prefix, grid = e.layout.num_prefix_tokens, e.layout.grid

    def reshape(tokens):
        patches = tokens[:, prefix:, :]
        return patches.reshape(patches.shape[0], *grid, patches.shape[-1]).permute(0, 3, 1, 2)

    cam = GradCAM(model=model, target_layers=[model.blocks[-1].norm1], reshape_transform=reshape)
    try:
        outputs = cam.activations_and_grads(x)
        targets = [(lambda row, c=int(c): row[c]) for c in classes]
        sum(t(row) for t, row in zip(targets, outputs)).backward()
        (acts,), (grads,) = cam.activations_and_grads.activations, cam.activations_and_grads.gradients
        expected = np.maximum(cam.get_cam_image(x, None, targets, acts.numpy(), grads.numpy(), False), 0)
    finally:
        cam.activations_and_grads.release()
    assert expected.shape == tuple(e.maps.shape) and expected.max() > 0
    np.testing.assert_allclose(e.maps.double().numpy(), expected, rtol=0, atol=RTOL * expected.max())
