"""CNN gates (SE, ECA, CBAM, ...) and the Grad-CAM family, against hand-written oracles.

Models are random-init (pretrained=False) at 32-64 px; BatchNorm statistics are randomised so
that gates and maps are not trivially constant. The shapes-cnn checks need the bundled weights.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

import vitexplain as vx
from cam_oracle import act_grad
from vitexplain.recording import GateSpec, register_gate, supported_gates
from vitexplain.recording import gates as gates_module
from vitexplain.errors import CaptureError, UnsupportedMethodError, UnsupportedModelError

CNN_METHODS = ["gradcam", "gradcam++", "layercam", "spatial", "channel"]


pytestmark = pytest.mark.usefixtures("one_thread")


# -- helpers -----------------------------------------------------------------------------------
def _randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.running_mean.copy_(0.1 * torch.randn(n, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(n, generator=gen))
                if m.affine:
                    m.weight.copy_(0.5 + torch.rand(n, generator=gen))
                    m.bias.copy_(0.1 * torch.randn(n, generator=gen))
    return model.eval()


def _timm(name: str, **kwargs) -> nn.Module:
    return _randomize_norms(timm.create_model(name, pretrained=False, **kwargs))


def _tv(name: str) -> nn.Module:
    return _randomize_norms(getattr(torchvision.models, name)(weights=None))


def _zoo_arch() -> nn.Module:
    """The shapes-cnn architecture (ECA, SE, CBAM, CBAM stages), random init."""
    from vitexplain.zoo.models import DEFAULT_CONFIGS, build

    return _randomize_norms(build(DEFAULT_CONFIGS["shapes-cnn"]))


def _fn(module: nn.Module):
    """The elementwise function an activation module computes, written out by hand."""
    name = type(module).__name__.lower()
    table = {
        "relu": lambda t: t.clamp(min=0),
        "silu": lambda t: t * torch.sigmoid(t),
        "swish": lambda t: t * torch.sigmoid(t),
        "sigmoid": torch.sigmoid,
        "hardsigmoid": lambda t: (t + 3).clamp(0, 6) / 6,
    }
    assert name in table, f"no hand-written function for {type(module).__name__}"
    return table[name]


def _conv1x1(t: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    return F.conv2d(t, conv.weight, conv.bias)


def _bn(t: torch.Tensor, bn: nn.Module) -> torch.Tensor:
    return (t - bn.running_mean[None, :, None, None]) / torch.sqrt(bn.running_var[None, :, None, None] + bn.eps) * bn.weight[
        None, :, None, None
    ] + bn.bias[None, :, None, None]


# Manual recomputation of each module's gates from its input x (B, C, h, w): (channel (B, C), spatial (B, h, w) | None)
def _oracle_se(m, x):  # timm SEModule
    assert isinstance(m.bn, nn.Identity) and not m.add_maxpool
    s = _conv1x1(_fn(m.act)(_conv1x1(x.mean((2, 3), keepdim=True), m.fc1)), m.fc2)
    return _fn(m.gate)(s).flatten(1), None


def _oracle_eca(m, x):  # timm EcaModule
    assert m.conv2 is None
    y = F.conv1d(x.mean((2, 3))[:, None, :], m.conv.weight, padding=(m.conv.kernel_size[0] - 1) // 2)
    return _fn(m.gate)(y)[:, 0], None


def _cbam_spatial(m, x1, light: bool):
    if light:
        z = 0.5 * x1.mean(1, keepdim=True) + 0.5 * x1.amax(1, keepdim=True)
    else:
        z = torch.cat([x1.mean(1, keepdim=True), x1.amax(1, keepdim=True)], 1)
    conv = m.spatial.conv.conv
    z = _bn(F.conv2d(z, conv.weight, conv.bias, padding=conv.padding), m.spatial.conv.bn)
    return torch.sigmoid(z)[:, 0]


def _oracle_cbam(m, x):  # timm CbamModule
    c = m.channel

    def mlp(p):
        return F.conv2d(F.conv2d(p, c.fc1.weight).clamp(min=0), c.fc2.weight)

    g = torch.sigmoid(mlp(x.mean((2, 3), keepdim=True)) + mlp(x.amax((2, 3), keepdim=True)))
    return g.flatten(1), _cbam_spatial(m, x * g, light=False)


def _oracle_light_cbam(m, x):  # timm LightCbamModule
    c = m.channel
    p = 0.5 * x.mean((2, 3), keepdim=True) + 0.5 * x.amax((2, 3), keepdim=True)
    g = torch.sigmoid(F.conv2d(F.conv2d(p, c.fc1.weight).clamp(min=0), c.fc2.weight))
    return g.flatten(1), _cbam_spatial(m, x * g, light=True)


def _oracle_timm_effnet_se(m, x):  # timm _efficientnet_blocks.SqueezeExcite
    s = _conv1x1(_fn(m.act1)(_conv1x1(x.mean((2, 3), keepdim=True), m.conv_reduce)), m.conv_expand)
    return _fn(m.gate)(s).flatten(1), None


def _oracle_tv_se(m, x):  # torchvision ops.SqueezeExcitation
    s = _conv1x1(_fn(m.activation)(_conv1x1(x.mean((2, 3), keepdim=True), m.fc1)), m.fc2)
    return _fn(m.scale_activation)(s).flatten(1), None


ORACLES = {
    "SEModule": _oracle_se,
    "EcaModule": _oracle_eca,
    "CbamModule": _oracle_cbam,
    "LightCbamModule": _oracle_light_cbam,
    "SqueezeExcite": _oracle_timm_effnet_se,
    "SqueezeExcitation": _oracle_tv_se,
}

@functools.lru_cache(maxsize=None)
def _model(key: str) -> nn.Module:
    return GATE_MODELS[key]()


GATE_MODELS = {
    "timm-se-resnet": lambda: _timm("resnet10t", num_classes=5, block_args=dict(attn_layer="se")),
    "timm-eca-resnet": lambda: _timm("resnet10t", num_classes=5, block_args=dict(attn_layer="eca")),
    "timm-cbam-resnet": lambda: _timm("resnet10t", num_classes=5, block_args=dict(attn_layer="cbam")),
    "timm-lcbam-resnet": lambda: _timm("resnet10t", num_classes=5, block_args=dict(attn_layer="lcbam")),
    "timm-mobilenetv3": lambda: _timm("mobilenetv3_small_100", num_classes=5),
    "tv-mobilenet_v3_small": lambda: _tv("mobilenet_v3_small"),
    "tv-efficientnet_b0": lambda: _tv("efficientnet_b0"),
    "tv-regnet_y_400mf": lambda: _tv("regnet_y_400mf"),
}


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        for m in model.modules()
    )


# -- gate capture ------------------------------------------------------------------------------
@pytest.mark.parametrize("key", list(GATE_MODELS))
def test_gates_equal_manual_recomputation(key):
    model = _model(key)
    x = torch.randn(2, 3, 32, 32)
    expected_modules = [n for n, m in model.named_modules() if type(m).__name__ in ORACLES]
    with torch.no_grad(), vx.capture(model, gates=True, attention=False) as rec:
        model(x)
    records = rec.gates
    assert [r.name for r in records] == expected_modules  # one record per module call, in call order
    assert _hook_count(model) == 0
    for r in records:
        module = model.get_submodule(r.name)
        channel, spatial = ORACLES[type(module).__name__](module, r.input)
        assert r.channel.shape == (2, r.input.shape[1])
        torch.testing.assert_close(r.channel, channel, rtol=1e-5, atol=1e-6)
        assert bool(((r.channel >= 0) & (r.channel <= 1)).all())
        if spatial is None:
            assert r.spatial is None
        else:
            assert r.spatial.shape == (2, *r.input.shape[-2:])
            torch.testing.assert_close(r.spatial, spatial, rtol=1e-5, atol=1e-6)
    assert any(float(r.channel.std()) > 1e-3 for r in records)  # not a trivial all-0.5 gate


def test_gates_are_what_the_module_multiplied_by():
    """output == input * channel gate (* spatial gate), for modules without a hand oracle too."""
    from timm.layers import create_attn
    from timm.layers.gather_excite import GatherExcite

    kinds = ["se", "ese", "eca", "ceca", "cbam", "lcbam", "gc"]
    # GatherExcite(use_mlp=True) does not build in timm 1.0.x (ConvMlp(..., *dd) bug): without the MLP
    attns = [create_attn(k, 16) for k in kinds] + [GatherExcite(16, use_mlp=False)]
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *attns).eval()
    names = [str(i + 1) for i in range(len(attns))]
    x = torch.randn(3, 3, 12, 12)
    with torch.no_grad(), vx.capture(model, gates=True, activations=names, attention=False) as rec:
        model(x)
    assert [r.name for r in rec.gates] == names
    for r in rec.gates:
        out = rec.activation(r.name).output
        ch = r.channel[:, :, None, None]
        if r.module in ("CbamModule", "LightCbamModule"):
            expected = (r.input * ch) * r.spatial[:, None]
        else:
            expected = r.input * ch
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=f"{r.module}")


def test_gather_excite_local_extent():
    from timm.layers.gather_excite import GatherExcite

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), GatherExcite(8, extent=2, use_mlp=False)).eval()
    with torch.no_grad(), vx.capture(model, gates=True, attention=False) as rec:
        model(torch.randn(2, 3, 8, 8))
    r = rec.gates[0]
    assert r.channel.shape == (2, 8) and r.spatial.shape == (2, 8, 8)


def test_explainer_gates_equal_capture_gates():
    """Explainer gate methods show exactly the gates vx.capture(gates=True) records."""
    model = _zoo_arch()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), vx.capture(model, gates=True, attention=False) as rec:
        model(x)
    e = vx.Explainer(model).explain(x, method="spatial", module="layer3")
    hooked = [r for r in rec.gates if r.name.startswith("layer3")][-1]
    torch.testing.assert_close(e.maps, hooked.spatial)
    c = vx.Explainer(model).explain(x, method="channel", k=4)
    torch.testing.assert_close(c.extras["gate"], rec.gates[-1].channel)
    # default spatial map: the mean of every spatial gate at the finest resolution
    gates = [r.spatial for r in rec.gates if r.spatial is not None]
    assert len({g.shape for g in gates}) == 1, "the zoo CNN's spatial gates share one resolution"
    default = vx.Explainer(model).explain(x, method="spatial")
    torch.testing.assert_close(default.maps, torch.stack(gates).mean(0))
    deepest = vx.Explainer(model).explain(x, method="spatial", module="deepest")
    torch.testing.assert_close(deepest.maps, gates[-1])


def test_register_gate_for_a_new_module():
    class MyGate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Conv2d(4, 4, 1)
            self.sig = nn.Sigmoid()

        def forward(self, x):
            return x * self.sig(self.proj(x.mean((2, 3), keepdim=True)))

    register_gate(MyGate)(lambda m: GateSpec(channel="sig"))
    try:
        model = nn.Sequential(nn.Conv2d(3, 4, 1), MyGate()).eval()
        x = torch.randn(2, 3, 5, 5)
        with torch.no_grad(), vx.capture(model, gates=True, attention=False) as rec:
            model(x)
        r = rec.gates[0]
        expected = torch.sigmoid(_conv1x1(r.input.mean((2, 3), keepdim=True), model[1].proj)).flatten(1)
        torch.testing.assert_close(r.channel, expected)
        assert any(name.endswith("MyGate") for name in supported_gates())
    finally:
        gates_module._REGISTRY.pop(MyGate)


def test_no_gates_clear_errors():
    model = _timm("resnet10t", num_classes=5)
    x = torch.randn(1, 3, 32, 32)
    with vx.capture(model, gates=True, attention=False) as rec:
        pass
    with pytest.raises(CaptureError, match="no forward"):
        rec.gates
    with torch.no_grad(), vx.capture(model, gates=True, attention=False) as rec:
        model(x)
    with pytest.raises(CaptureError, match="SEModule.*CbamModule.*SqueezeExcitation"):
        rec.gates
    with torch.no_grad(), vx.capture(model, attention=False) as rec:
        model(x)
    with pytest.raises(CaptureError, match="gates=True"):
        rec.gates
    with pytest.raises(UnsupportedMethodError, match="SEModule"):
        vx.Explainer(model).explain(x, method="spatial")
    se = _timm("resnet10t", num_classes=5, block_args=dict(attn_layer="se"))
    with pytest.raises(UnsupportedMethodError, match="no spatial attention gate"):
        vx.Explainer(se).explain(x, method="spatial")
    with pytest.raises(UnsupportedModelError, match="Sequential"):  # names the model it cannot explain
        vx.Explainer(nn.Sequential(nn.Flatten(), nn.Linear(12, 3)))



def test_a_module_without_a_feature_map_names_the_option_to_pass():
    """gradcam on a module whose output is not (B, C, h, w) (the classifier) says to pass
    module= (the option's name); it said layer=, which the method refuses as unknown."""
    model = _timm("resnet10t", num_classes=5)
    ex = vx.Explainer(model)
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(UnsupportedMethodError, match=r"'fc' has shape \(1, 5\).*pass module= a module") as info:
        ex.explain(x, method="gradcam", module="fc")
    advice = str(info.value).split("pass ")[-1].split("=")[0]
    assert advice in ex.plan("gradcam").steps[0].spec.options  # the advice is an option the method takes


def test_a_model_in_training_mode_keeps_its_batch_norm_statistics():
    """The explained forward of a model in training mode updated its batch-norm running
    statistics (and counters): the user's model was not left as found."""
    model = _timm("resnet10t", num_classes=5).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 32, 32)
    with pytest.warns(UserWarning, match="training mode.*batch norm"):
        vx.Explainer(model).explain(x, method=["gradcam", "layercam"])
    with pytest.warns(UserWarning, match="training mode"):
        vx.Explainer(model).explain(x, method="gradcam", module="layer2")  # a second forward of its own
    after = model.state_dict()
    assert model.training and before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed

# -- adapters ----------------------------------------------------------------------------------
def test_target_layers():
    from vitexplain.adapters import adapter_for

    assert adapter_for(_zoo_arch()).target_layer == "layer4"
    assert adapter_for(_model("timm-mobilenetv3")).target_layer == "blocks.5"
    assert adapter_for(_model("tv-mobilenet_v3_small")).target_layer == "features.12"
    assert adapter_for(_model("tv-efficientnet_b0")).target_layer == "features.8"
    assert adapter_for(_model("tv-regnet_y_400mf")).target_layer == "trunk_output.block4"
    assert adapter_for(torchvision.models.resnet18(weights=None)).target_layer == "layer4"
    for model in (_zoo_arch(), torchvision.models.resnet18(weights=None)):
        assert adapter_for(model).family == "cnn" and not hasattr(adapter_for(model), "layout")
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8)
    assert adapter_for(vit).family == "vit"


# -- Grad-CAM family ---------------------------------------------------------------------------
def _act_grad_oracle(model, layer, x, classes):
    """A and dy/dA of layer ``layer`` by hand (tests/cam_oracle.py), float64 NumPy."""
    a, grad = act_grad(model, layer, x, classes)
    return a.double().numpy(), grad.double().numpy()


def _gradcam_oracle(a, g):
    w = g.mean(axis=(2, 3))
    return np.maximum((w[:, :, None, None] * a).sum(1), 0)


def _gradcam_pp_oracle(a, g):
    # pytorch-grad-cam's GradCAMPlusPlus, with 0 instead of eps where the gradient is 0
    g2, g3 = g**2, g**3
    denom = 2 * g2 + a.sum(axis=(2, 3))[:, :, None, None] * g3
    safe = np.where(denom != 0, denom, 1.0)
    alpha = np.where(g != 0, g2 / safe, 0.0)
    w = (np.maximum(g, 0) * alpha).sum(axis=(2, 3))
    return np.maximum((w[:, :, None, None] * a).sum(1), 0)


def _layercam_oracle(a, g):
    return np.maximum((np.maximum(g, 0) * a).sum(1), 0)


@pytest.fixture(scope="module")
def zoo_arch_batch():
    torch.manual_seed(1)
    return _zoo_arch(), torch.randn(4, 3, 64, 64), torch.tensor([0, 1, 2, 3])


@pytest.mark.parametrize(
    "method, oracle, layer",
    [
        ("gradcam", _gradcam_oracle, None),
        ("gradcam++", _gradcam_pp_oracle, None),
        ("layercam", _layercam_oracle, None),
        ("gradcam", _gradcam_oracle, "layer3"),
        ("gradcam++", _gradcam_pp_oracle, "layer3.0.conv1"),  # not a stage: a second pass
        ("layercam", _layercam_oracle, "layer2"),
    ],
)
def test_grad_cams_equal_oracles(zoo_arch_batch, method, oracle, layer):
    model, x, classes = zoo_arch_batch
    options = {} if layer is None else {"module": layer}
    e = vx.Explainer(model).explain(x, method=method, target=classes, **options)
    a, g = _act_grad_oracle(model, layer or "layer4", x, classes)
    expected = oracle(a, g)
    assert e.maps.shape == expected.shape and float(np.abs(expected).max()) > 0
    np.testing.assert_allclose(e.maps.double().numpy(), expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    assert e.targets.tolist() == classes.tolist()


def test_cam_family_shares_one_forward_and_gradcam_equals_captum(zoo_arch_batch):
    """The three CAM variants of one call run one forward (and one backward) between them, and
    Grad-CAM equals captum's LayerGradCam (a peer's own code) on the same weights."""
    from captum.attr import LayerGradCam

    model, x, classes = zoo_arch_batch
    forwards = []
    handle = model.register_forward_hook(lambda m, i, o: forwards.append(1))
    try:
        maps = vx.Explainer(model).explain(x, method=["gradcam", "gradcam++", "layercam"], target=classes)
    finally:
        handle.remove()
    assert len(forwards) == 1
    with torch.enable_grad():
        peer = LayerGradCam(model, model.layer4).attribute(x, target=classes, relu_attributions=True)
    torch.testing.assert_close(maps[0].maps, peer.detach().sum(1), rtol=1e-4, atol=1e-6)


def test_batch_of_four_equals_four_batches_of_one(zoo_arch_batch):
    model, x, classes = zoo_arch_batch
    ex = vx.Explainer(model)
    together = ex.explain(x, method=CNN_METHODS, target=classes)
    for i in range(4):
        alone = ex.explain(x[i : i + 1], method=CNN_METHODS, target=classes[i : i + 1])
        for a, b in zip(together, alone):
            torch.testing.assert_close(a.maps[i : i + 1], b.maps, rtol=1e-4, atol=1e-5, msg=a.method)
    extras = together[-1].extras
    k = extras["indices"].shape[1]
    assert k == 8 and extras["channel_maps"].shape == (4, k, 8, 8)
    assert bool((extras["values"][:, :-1] >= extras["values"][:, 1:]).all())
    gate = extras["gate"]
    torch.testing.assert_close(extras["values"], gate.gather(1, extras["indices"]))


# -- restoration -------------------------------------------------------------------------------
def test_model_state_restored(zoo_arch_batch):
    _, x, classes = zoo_arch_batch
    model = _zoo_arch()
    model.fc.train()  # a mixed state (that does not change the outputs), left as found
    model.layer2[0].conv1.weight.requires_grad_(False)
    marker = torch.full_like(model.fc.weight, 7.0)
    model.fc.weight.grad = marker.clone()
    flags = [m.training for m in model.modules()]
    req = [p.requires_grad for p in model.parameters()]

    vx.Explainer(model).explain(x[:1], method=CNN_METHODS, target=classes[:1])
    assert _hook_count(model) == 0
    assert [m.training for m in model.modules()] == flags
    assert [p.requires_grad for p in model.parameters()] == req
    torch.testing.assert_close(model.fc.weight.grad, marker)
    assert all(p.grad is None for n, p in model.named_parameters() if n != "fc.weight")

    with pytest.raises(RuntimeError, match="boom"):
        with vx.capture(model, gates=True, grads=True, activations=["layer4"], attention=False):
            model(x[:1])
            raise RuntimeError("boom")
    assert _hook_count(model) == 0
    with pytest.raises(vx.InputError, match="takes 3 channels"):  # refused before the forward
        vx.Explainer(model).explain(torch.randn(1, 5, 64, 64), method=CNN_METHODS)

    def boom(module, inputs):
        raise RuntimeError("boom inside the forward")

    handle = model.layer3.register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom inside the forward"):
            vx.Explainer(model).explain(x[:1], method=CNN_METHODS, target=classes[:1])
    finally:
        handle.remove()
    assert _hook_count(model) == 0
    assert [m.training for m in model.modules()] == flags
    assert [p.requires_grad for p in model.parameters()] == req
    torch.testing.assert_close(model.fc.weight.grad, marker)


# -- viz ---------------------------------------------------------------------------------------
def test_channel_tiles(zoo_arch_batch):
    model, x, _ = zoo_arch_batch
    e = vx.Explainer(model).explain(x[:2], method="channel", k=4)
    image = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    fig = vx.viz.channel_tiles(image, e, k=4, index=1)
    assert fig.dtype == np.uint8 and fig.ndim == 3 and fig.shape[2] == 3
    fig2 = vx.viz.channel_tiles(image, e.extras, k=3)
    assert fig2.shape[1] < fig.shape[1]


# -- shapes-cnn (bundled weights; missing weights fail: vx.zoo.load raises) ---------------------
@pytest.fixture(scope="module")
def shapes_two_objects():
    """100 held-out images with two objects of different classes each."""
    model = vx.zoo.load("shapes-cnn")
    batch = vx.data.shapes(n=100, seed=10_000, num_objects=2, distinct_classes=True)
    return vx.Explainer(model), batch


# Floors: measured on these images, minus three binomial standard errors sqrt(p (1 - p) / n),
# rounded down to 2 decimals.
def test_shapes_cnn_gradcam_is_class_discriminative(shapes_two_objects):
    """Each object's class targeted in turn: gradcam's maximum lands on that object (pointing game)."""
    ex, batch = shapes_two_objects
    hits = []
    for j in range(2):
        classes = torch.stack([c[j] for c in batch.classes])
        masks = torch.stack([m[j] for m in batch.masks])
        e = ex.explain(batch.tensor, method="gradcam", target=classes)
        hits.append(vx.metrics.pointing_game(e.maps, masks))
    accuracy = float(torch.cat(hits).float().mean())
    print(f"shapes-cnn gradcam class-discriminative pointing: {accuracy:.3f} over {len(torch.cat(hits))}")
    assert accuracy >= 0.98, accuracy  # measured 0.995, n = 200


def test_shapes_cnn_spatial_gate_points_at_objects(shapes_two_objects):
    """The maximum of the default spatial map (mean of the spatial gates) lies on some object."""
    ex, batch = shapes_two_objects
    union = torch.stack([m.any(0) for m in batch.masks])
    s = ex.explain(batch.tensor, method="spatial")
    accuracy = float(vx.metrics.pointing_game(s.maps, union).float().mean())
    print(f"shapes-cnn spatial ({s.extras['module']}) pointing: {accuracy:.3f} over {len(union)}")
    assert accuracy >= 0.79, accuracy  # measured 0.890, n = 100
