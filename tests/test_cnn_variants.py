"""CNN variants the other CNN tests do not build (found by a sweep of torchvision, timm and Hugging Face CNNs at
random init, small and non-square inputs, batches of 1-3, channels-last):

- torchvision GoogLeNet built with ``aux_logits=True``: its auxiliary classifiers (``aux1``, ``aux2``) are top-level
  children after ``inception5b`` that run only in training; the stage finder took ``aux2`` as the last stage, and
  every Grad-CAM call in eval failed with "nothing captured is part of an autograd graph".
- One image's Grad-CAM through an eval BatchNorm whose output is read as tokens (``x.flatten(2).transpose(1, 2)``:
  EfficientFormer's last stage, a hybrid's patch embedding): PyTorch's CPU batch_norm backward is wrong for that
  channels-last gradient of a contiguous input at batch 1 (methods/grad_layout.py), so a module before such a norm
  got a map of one image that differed from the same image's map in a batch of two by its own size.
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

import vitexplain as vx
from peers import require
from vitexplain.adapters.cnn import CNNAdapter

METHODS = ["gradcam", "gradcam++", "layercam"]


def test_googlenet_with_aux_classifiers_reads_its_last_inception_block():
    require("pytorch_grad_cam", "pip install --no-deps grad-cam==1.5.7 ttach (test-only peer)")
    from pytorch_grad_cam import GradCAM

    torch.manual_seed(0)
    model = torchvision.models.googlenet(num_classes=5, aux_logits=True, init_weights=False).eval()
    x = torch.randn(2, 3, 64, 80, generator=torch.Generator().manual_seed(1))
    classes = torch.tensor([1, 3])
    ex = vx.Explainer(model)
    assert ex.adapter.target_layer == "inception5b" and not any("aux" in s for s in ex.adapter.stages)
    got = ex.explain(x, method="gradcam", target=classes).maps
    # the peer's map before its scaling and resize (tests/test_cnn_gradcam_peer.py)
    cam = GradCAM(model=model, target_layers=[model.inception5b])
    try:
        outputs = cam.activations_and_grads(x)
        outputs[torch.arange(2), classes].sum().backward()
        (acts,), (grads,) = cam.activations_and_grads.activations, cam.activations_and_grads.gradients
        expected = torch.from_numpy(cam.get_cam_image(x, None, None, acts.numpy(), grads.numpy(), False)).clamp(min=0)
    finally:
        cam.activations_and_grads.release()
        model.zero_grad(set_to_none=True)
    assert got.shape == expected.shape == (2, 2, 3) and float(expected.max()) > 0
    torch.testing.assert_close(got, expected.float(), rtol=0, atol=1e-5 * float(expected.max()))
    model.train()  # in training the auxiliary classifiers run, and still are not a feature stage
    assert vx.Explainer(model).adapter.target_layer == "inception5b"


class _NormThenTokens(nn.Module):
    """A conv stage, an eval BatchNorm whose output is read as tokens (EfficientFormer's ``Flat``), a token
    LayerNorm and MLP, mean pooling and a head. At batch 1 the LayerNorm's backward hands the BatchNorm a gradient
    of strides (C, 1, W * C, C), which PyTorch's kernel gets wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.norm = nn.BatchNorm2d(16)
        self.mlp = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU())
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.norm(self.body(self.stem(x))).flatten(2).transpose(1, 2)  # (B, N, C)
        return self.fc(self.mlp(tokens).mean(1))


def _norm_then_tokens() -> nn.Module:
    torch.manual_seed(3)
    model = _NormThenTokens().eval()
    with torch.no_grad():  # statistics that are not the identity
        model.norm.running_mean.uniform_(-0.5, 0.5)
        model.norm.running_var.uniform_(0.5, 2.0)
        model.norm.weight.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("module", ["body", "stem", "stem.0"])  # a stage (the shared pass), and modules that are not
def test_one_image_through_a_tokenising_batch_norm_equals_its_map_in_a_batch(module, method):
    """Image i alone equals row i of the batch of two, and both equal a float64 hand-written oracle on the batch
    of two (which the PyTorch bug does not affect: its gradient's strides are not channels-last)."""
    model = _norm_then_tokens()
    x = torch.randn(2, 3, 24, 40, generator=torch.Generator().manual_seed(4))
    classes = torch.tensor([2, 4])
    ex = vx.Explainer(model, adapter=CNNAdapter(model, stages=["stem", "body"]))
    both = ex.explain(x, method=method, target=classes, module=module).maps
    ones = torch.cat([ex.explain(x[i:i + 1], method=method, target=classes[i:i + 1], module=module).maps
                      for i in range(2)])

    oracle = _norm_then_tokens().double()
    seen = {}
    handle = oracle.get_submodule(module).register_forward_hook(lambda m, i, o: seen.update(a=o))
    try:
        out = oracle(x.double())
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(out[torch.arange(2), classes].sum(), seen["a"])
    act = seen["a"].detach()
    if method == "gradcam":
        expected = (grad.mean((2, 3), keepdim=True) * act).sum(1).clamp(min=0)
    elif method == "layercam":
        expected = (grad.clamp(min=0) * act).sum(1).clamp(min=0)
    else:
        g2, g3 = grad ** 2, grad ** 3
        alpha = g2 / torch.where(grad != 0, 2 * g2 + act.sum((2, 3), keepdim=True) * g3, torch.ones_like(g2))
        expected = ((alpha * grad.clamp(min=0)).sum((2, 3), keepdim=True) * act).sum(1).clamp(min=0)
    scale = float(expected.max())
    assert scale > 0
    torch.testing.assert_close(both.double(), expected, rtol=0, atol=1e-4 * scale)
    torch.testing.assert_close(ones.double(), expected, rtol=0, atol=1e-4 * scale)


class _Wrapped(nn.Module):
    """A ResNet-18 whose forward returns a dict {"logits", "features"} or a tuple (logits, features)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.net, self.kind = torchvision.models.resnet18(num_classes=5), kind

    def forward(self, x: torch.Tensor):
        logits = self.net(x)
        return {"logits": logits, "features": x.mean((2, 3))} if self.kind == "dict" else (logits, x.mean((2, 3)))


@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_a_forward_that_returns_a_dict_or_tuple_explains_its_logits(kind):
    """The logits under a plain dict's "logits" key (a dict was refused: "cannot find logits") or a tuple's first
    item: maps, predicted classes and logits equal the bare network's."""
    model = _Wrapped(kind).eval()
    x = torch.randn(2, 3, 48, 64, generator=torch.Generator().manual_seed(6))
    got = vx.Explainer(model).explain(x, method=METHODS)
    bare = vx.Explainer(model.net).explain(x, method=METHODS)
    for g, b in zip(got, bare):
        assert torch.equal(g.targets, b.targets) and float(b.maps.max()) > 0
        torch.testing.assert_close(g.maps, b.maps, rtol=0, atol=1e-6 * float(b.maps.max()))
        torch.testing.assert_close(g.logits, b.logits)


def _hf_resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(7)
    config = ResNetConfig(num_labels=5, depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 24, 32], embedding_size=8)
    return ResNetForImageClassification(config).eval()


@pytest.mark.parametrize("build, module", [
    (_hf_resnet, "resnet.encoder.stages"),     # a ModuleList: never called itself
    (_hf_resnet, "resnet.encoder"),            # runs, but returns a ModelOutput
    (lambda: torchvision.models.googlenet(num_classes=5, aux_logits=True, init_weights=False).eval(), "aux1"),  # eval
])
def test_a_module_that_gives_no_tensor_is_refused_with_what_to_pass(build, module):
    """module= a module that gives no tensor in the eval forward is refused by the method with the stages to pass
    (it was a CaptureError that said an encoder that ran 'did not run')."""
    model = build()
    ex = vx.Explainer(model)
    with pytest.raises(vx.UnsupportedMethodError, match=rf"'{module}' gave no tensor.*{ex.adapter.stages[-1]}"):
        ex.explain(torch.randn(1, 3, 32, 48), method="gradcam", module=module, target=1)


@pytest.mark.parametrize("method", METHODS)
def test_a_fused_graph_module_reads_the_last_leaf_that_runs_once(method):
    """torch.fx's ``fuse`` (Conv+BN folded) returns a GraphModule that calls its leaf modules directly: its
    container ``features`` never runs, and every Grad-CAM call failed with "nothing captured is part of an
    autograd graph". Its stage is now the last leaf before the pooling (``features.18.2``, the ReLU6 whose output
    is the unfused ``features``' output), and the map equals the unfused model's (BN folding moves it by
    float32 rounding)."""
    from torch.fx.experimental.optimization import fuse

    torch.manual_seed(8)
    model = torchvision.models.mobilenet_v2(num_classes=5).eval()
    fused = fuse(model)
    x = torch.randn(2, 3, 48, 64, generator=torch.Generator().manual_seed(9))
    ex = vx.Explainer(fused)
    assert ex.adapter.target_layer == "features.18.2"
    got = ex.explain(x, method=method, target=torch.tensor([0, 3])).maps
    expected = vx.Explainer(model).explain(x, method=method, target=torch.tensor([0, 3])).maps
    assert float(expected.max()) > 0
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * float(expected.max()))
