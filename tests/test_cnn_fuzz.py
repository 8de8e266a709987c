"""What fuzzing the CNN side found (models, sizes and layers the other CNN tests do not use), each
checked against an independent expectation: the advice of an error is followed and then works, a
map equals its formula on the model's own forward.
"""

from __future__ import annotations

import re

import pytest
import timm
import torchvision
import torch

import vitexplain as vx
from support_table import reinit_heads


pytestmark = pytest.mark.usefixtures("one_thread")


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


# timm CNNs with self-attention blocks: each attention module takes only some feature-map sizes (BotNet's
# BottleneckAttn keeps relative positions for one grid, HaloNet's HaloAttn splits the map into fixed blocks,
# LambdaNet's strided LambdaLayer halves it with an average pool the shortcut does not match), and another size
# failed inside the model with a bare AssertionError or a tensor-size RuntimeError that named no size
SELF_ATTENTION = {
    # name: (build, a size it refuses, the size or multiple the error must give)
    "botnet26t built for 64": (lambda: timm.create_model("botnet26t_256", img_size=64, num_classes=5), (96, 64),
                               r"takes 64x64 images only"),
    "halonet26t": (lambda: timm.create_model("halonet26t", num_classes=5), (96, 160),
                   r"multiples of 256: .*e\.g\. to 256x256"),
    "lambda_resnet26t": (lambda: timm.create_model("lambda_resnet26t", num_classes=5), (48, 80),
                         r"multiples of 32: .*e\.g\. to 64x96"),
}


@pytest.mark.parametrize("name", list(SELF_ATTENTION))
def test_a_cnn_with_self_attention_refuses_a_size_it_does_not_take_and_the_size_it_names_works(name):
    build, size, advice = SELF_ATTENTION[name]
    torch.manual_seed(0)
    model = build().eval()
    ex = vx.Explainer(model)
    assert ex.family.name == "cnn" and "gradcam" in ex.methods()
    with pytest.raises(vx.InputError, match=rf"does not take a {size[0]}x{size[1]} input .*self_attn.*{advice}") as info:
        ex.explain(torch.randn(1, 3, *size), method="gradcam")
    assert _hooks(model) == 0 and not model.training
    suggested = tuple(int(s) for s in re.search(r"(\d+)x(\d+) images only|e\.g\. to (\d+)x(\d+)", str(info.value)).groups() if s)
    e = ex.explain(torch.randn(2, 3, *suggested), method="gradcam", target=[1, 3])  # the advice, followed, works
    assert e.maps.shape[0] == 2 and bool(torch.isfinite(e.maps).all())
    assert _hooks(model) == 0


# CNNs whose own forward fails on some sizes: multi-resolution fusion (HRNet), aggregation of stages
# (DLA) and blur-pool shortcuts (ResNet-AA) need the sides to halve evenly, TResNet's space-to-depth stem
# needs multiples of 4, Inception-v3 and SqueezeNet need a minimum size; each failed with a raw
# tensor-size RuntimeError
SIZE_BOUND = {
    # name: (build, a size it refuses, the size the error must give)
    "timm hrnet_w18_small": (lambda: timm.create_model("hrnet_w18_small", num_classes=5), (67, 91), "64x96"),
    "timm dla46_c": (lambda: timm.create_model("dla46_c", num_classes=5), (67, 91), "64x96"),
    "timm resnetaa34d": (lambda: timm.create_model("resnetaa34d", num_classes=5), (33, 47), "32x32"),
    "timm tresnet_m": (lambda: timm.create_model("tresnet_m", num_classes=5), (67, 91), "64x96"),
    "torchvision inception_v3": (lambda: torchvision.models.inception_v3(
        weights=None, num_classes=5, aux_logits=False, init_weights=False), (67, 91), "299x299"),  # its weights' size
    "torchvision squeezenet1_1": (lambda: torchvision.models.squeezenet1_1(num_classes=5), (16, 16), "32x32"),
}


@pytest.mark.parametrize("name", list(SIZE_BOUND))
def test_a_cnn_that_fails_on_a_size_says_so_and_names_a_size_it_takes(name):
    build, size, takes = SIZE_BOUND[name]
    torch.manual_seed(0)
    model = build().eval()
    ex = vx.Explainer(model)
    with pytest.raises(vx.InputError, match=rf"does not take a {size[0]}x{size[1]} input .*runs on {takes} images") as info:
        ex.explain(torch.randn(1, 3, *size), method="gradcam")
    assert isinstance(info.value.__cause__, RuntimeError)  # the model's own message is kept
    assert _hooks(model) == 0 and not model.training
    suggested = tuple(int(s) for s in takes.split("x"))
    e = ex.explain(torch.randn(2, 3, *suggested), method="gradcam", target=[1, 3])  # the advice, followed, works
    assert e.maps.shape[0] == 2 and bool(torch.isfinite(e.maps).all())


def test_grad_cams_of_a_float64_model_are_computed_in_float64():
    """Grad-CAM++'s weights divide by 2 g^2 + sum(A) g^3, which nearly cancels at some positions: the
    package cast a float64 model's activations and gradients to float32 first, and its map differed from the
    float64 formula by 2.8e-4 of its largest value (NF-RegNet, score scaled by 1e4 as the peer comparison
    does). Oracle: the formulas written here, in float64, on the model's own activation and gradient; the
    float64 maps are returned as float32 (their rounding: 6e-8 relative), so the bound is 1e-6."""
    torch.manual_seed(1)
    model = timm.create_model("nf_regnet_b0", num_classes=5).eval().double()
    x = torch.randn(3, 3, 75, 107, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    classes = torch.tensor([3, 0, 4])
    ex = vx.Explainer(model)
    layer = ex.adapter.target_layer
    store = {}
    handle = model.get_submodule(layer).register_forward_hook(lambda m, i, o: store.__setitem__("a", o))
    try:
        score = 1e4 * model(x)[torch.arange(3), classes].sum()
    finally:
        handle.remove()
    (g,) = torch.autograd.grad(score, store["a"])
    a = store["a"].detach()
    g2, g3 = g**2, g**3
    denom = 2 * g2 + a.sum((2, 3), keepdim=True) * g3
    alpha = torch.where(g != 0, g2 / torch.where(denom != 0, denom, torch.ones_like(denom)), torch.zeros_like(g))
    expected = {
        "gradcam": (g.mean((2, 3), keepdim=True) * a).sum(1).clamp(min=0),
        "gradcam++": ((alpha * g.clamp(min=0)).sum((2, 3), keepdim=True) * a).sum(1).clamp(min=0),
        "layercam": (g.clamp(min=0) * a).sum(1).clamp(min=0),
    }
    for method, want in expected.items():
        e = ex.explain(x, method=method, target=lambda out: 1e4 * out[torch.arange(3), classes])
        assert e.maps.dtype == torch.float32 and want.max() > 0
        error = float((e.maps.double() - want).abs().max() / want.max())
        assert error < 1e-6, (method, error)


# CNNs whose blocks call a softmax (so they are explained as conv/attention hybrids, the Grad-CAM family only):
# the refusal of the attention methods said "vx.capture(model) records every attention call", but capture
# records none of these (NoAttentionError): a selective-kernel or split-attention softmax runs over branches,
# a global-context or lambda softmax over positions with no queries, BotNet's token attention is 3-D
HYBRID_BLOCKS = {
    # name: (build, input size, words the reason must hold)
    "timm skresnet18": (lambda: timm.create_model("skresnet18", num_classes=5), 64, "SelectiveKernel"),
    "timm resnest14d": (lambda: timm.create_model("resnest14d", num_classes=5), 64, "SplitAttn"),
    "timm resnet + gc": (lambda: timm.create_model("resnet10t", num_classes=5, block_args=dict(attn_layer="gc")), 64,
                         "GlobalContext"),
    "timm gcresnet33ts": (lambda: timm.create_model("gcresnet33ts", num_classes=5), 64, "GlobalContext"),
    "timm lambda_resnet26t": (lambda: timm.create_model("lambda_resnet26t", num_classes=5), 64, "LambdaLayer"),
    "timm botnet26t": (lambda: timm.create_model("botnet26t_256", num_classes=5, img_size=64), 64, "BottleneckAttn"),
}


def test_halonet_is_not_recorded_as_attention_of_the_wrong_layout():
    """HaloNet's softmax is 4-D, (B * heads, blocks, block positions, window positions): vx.capture recorded it
    as if it were (B, heads, N, N), so r.probs() of one image had 8 "images" and its blocks as "heads"
    (silently wrong; the refusal said capture records every attention call). Capture now leaves it out (a clear
    NoAttentionError on HaloNet), and the refusal of the attention methods says why."""
    torch.manual_seed(0)
    model = timm.create_model("halonet26t", num_classes=5).eval()
    x = torch.randn(1, 3, 256, 256)
    with pytest.raises(vx.UnsupportedMethodError, match=r"HaloAttn .*vx\.capture does not record it"):
        vx.Explainer(model).explain(x, method="rollout")
    with pytest.raises(vx.NoAttentionError):
        with torch.no_grad(), vx.capture(model) as rec:
            model(x)
        rec.records


def test_halonet_grad_cam_family_is_its_formula_on_the_last_stage_and_a_batch_equals_its_images():
    """What HaloNet is offered (the support matrix's tiny build, halo attention in two stages): the Grad-CAM family
    on its last feature stage (``final_conv``), each map its formula on the model's own forward and gradient
    (hand-written here), a batch of 3 equal to its images one by one; the attention methods refused (HaloAttn)."""
    from support_table import _halonet

    torch.manual_seed(0)
    model = _halonet().eval()
    reinit_heads(model)
    ex = vx.Explainer(model)
    assert ex.methods() == ["gradcam", "gradcam++", "layercam"]
    x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    kept = []
    handle = model.final_conv.register_forward_hook(lambda m, i, o: kept.append(o))
    logits = model(x)
    handle.remove()
    act = kept[0]
    (grad,) = torch.autograd.grad(logits[:, 1].sum(), act)
    act = act.detach()
    want = {
        "gradcam": torch.relu((grad.mean(dim=(2, 3), keepdim=True) * act).sum(1)),
        "layercam": torch.relu((torch.relu(grad) * act).sum(1)),
    }
    for method, expected in want.items():
        assert bool((expected.flatten(1).amax(1) > 0).all())  # a map with something on it, per image
        e = ex.explain(x, method=method, target=1)
        torch.testing.assert_close(e.maps, expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-4)
        alone = torch.cat([ex.explain(x[i : i + 1], method=method, target=1).maps for i in range(3)])
        torch.testing.assert_close(alone, e.maps, atol=1e-5 * float(expected.abs().max()), rtol=1e-4)
    with pytest.raises(vx.UnsupportedMethodError, match="HaloAttn"):
        ex.explain(x, method="cdam", target=1)


@pytest.mark.parametrize("name", list(HYBRID_BLOCKS))
def test_a_cnn_whose_blocks_call_a_softmax_is_refused_attention_methods_with_what_its_blocks_do(name):
    build, side, kind = HYBRID_BLOCKS[name]
    torch.manual_seed(0)
    model = build().eval()
    reinit_heads(model)  # timm zero-initialises each residual branch's last norm: Grad-CAM would be 0
    ex = vx.Explainer(model)
    x = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1))
    with pytest.raises(vx.UnsupportedMethodError, match=rf"{kind}") as info:
        ex.explain(x, method="rollout")
    assert "records every attention call" not in str(info.value)
    if kind == "BottleneckAttn":  # what the reason says: recorded, as (B, heads, N, N) over the block's positions
        assert "does not record" not in str(info.value)
        with torch.no_grad(), vx.capture(model) as rec:
            model(x)
        for record in rec.records:
            probs = record.probs()
            assert probs.shape[0] == 2 and probs.shape[-1] == probs.shape[-2]
            torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
    else:
        with pytest.raises(vx.NoAttentionError):  # what the reason must not contradict
            with torch.no_grad(), vx.capture(model) as rec:
                model(x)
            rec.records
    e = ex.explain(x, method="gradcam", target=[2, 0])  # what it runs: Grad-CAM, equal to the formula by hand
    assert_gradcam_is_the_formula(model, ex.adapter.target_layer, x, torch.tensor([2, 0]), e.maps)


def assert_gradcam_is_the_formula(model, layer, x, classes, maps):
    """``maps`` equal ReLU(sum_c mean(dy/dA_c) A_c) on ``layer``'s output A in the model's own forward."""
    store = {}
    handle = model.get_submodule(layer).register_forward_hook(lambda m, i, o: store.__setitem__("a", o))
    try:
        score = model(x)[torch.arange(len(x)), classes].sum()
    finally:
        handle.remove()
    (g,) = torch.autograd.grad(score, store["a"])
    want = (g.mean((2, 3), keepdim=True) * store["a"].detach()).sum(1).clamp(min=0)
    assert want.max() > 0
    torch.testing.assert_close(maps, want, rtol=1e-5, atol=1e-6 * float(want.max()))


class _Normalize(torch.nn.Module):
    def forward(self, x):
        return (x - 0.45) / 0.225


# a classifier inside a wrapper (a normalisation layer in front, DataParallel): the Grad-CAM family was listed,
# then refused ("the output of '1' has shape (2, 5)"): the last stage found was the whole wrapped classifier
WRAPPED = {
    "Sequential(normalize, torchvision resnet18)": (
        lambda inner: torch.nn.Sequential(_Normalize(), inner), "1.layer4"),
    "DataParallel(torchvision resnet18)": (lambda inner: torch.nn.DataParallel(inner), "module.layer4"),
}


@pytest.mark.parametrize("name", list(WRAPPED))
def test_a_wrapped_cnn_is_explained_at_the_last_stage_of_the_classifier_inside(name):
    wrap, layer = WRAPPED[name]
    torch.manual_seed(0)
    inner = torchvision.models.resnet18(num_classes=5).eval()
    model = wrap(inner).eval()
    x = torch.randn(2, 3, 48, 80, generator=torch.Generator().manual_seed(1))
    classes = torch.tensor([1, 4])
    ex = vx.Explainer(model)
    assert ex.adapter.target_layer == layer
    e = ex.explain(x, method="gradcam", target=classes)
    assert_gradcam_is_the_formula(model, layer, x, classes, e.maps)  # on the inner layer4, in the wrapper's forward
    assert _hooks(model) == 0


def _hf_resnet_without_labels():
    import transformers

    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_labels=0))


def _headless(model, attribute):
    setattr(model, attribute, torch.nn.Identity())
    return model


# CNNs whose head was removed (a feature extractor): a Hugging Face classifier with num_labels=0 returns its pooled
# features as "logits", and target=None explained the largest feature as if it were a class (silently); torchvision's
# ResNet with fc = Identity was refused as a model vitexplain does not know
HEADLESS = {
    "Hugging Face ResNet, num_labels=0": _hf_resnet_without_labels,
    "torchvision resnet18, fc=Identity": lambda: _headless(torchvision.models.resnet18(), "fc"),
    "torchvision mobilenet_v3_small, classifier=Identity": (
        lambda: _headless(torchvision.models.mobilenet_v3_small(), "classifier")),
}


@pytest.mark.parametrize("name", list(HEADLESS))
def test_a_cnn_without_a_head_asks_for_a_target_and_explains_a_callable_one(name):
    if "Hugging" in name:
        pytest.importorskip("transformers")
    build = HEADLESS[name]
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(1))
    ex = vx.Explainer(model)
    with pytest.raises(vx.TargetError, match="no classifier head"):
        ex.explain(x, method="gradcam")
    e = ex.explain(x, method="gradcam", target=vx.targets.norm())
    layer = ex.adapter.target_layer
    store = {}  # oracle: Grad-CAM by hand of the embedding's norm on the model's own forward
    handle = model.get_submodule(layer).register_forward_hook(lambda m, i, o: store.__setitem__("a", o))
    try:
        out = model(pixel_values=x).logits if "Hugging" in name else model(x)
    finally:
        handle.remove()
    (g,) = torch.autograd.grad(out.flatten(1).norm(dim=1).sum(), store["a"])
    want = (g.mean((2, 3), keepdim=True) * store["a"].detach()).sum(1).clamp(min=0)
    assert want.max() > 0
    torch.testing.assert_close(e.maps, want, rtol=1e-5, atol=1e-6 * float(want.max()))


def test_a_global_context_block_that_adds_its_context_is_named_as_having_no_gate():
    """GC-ResNet's GlobalContext modules add their context (fuse_add) and scale by no gate: 'channel' was refused
    with "has no attention-gate module vitexplain can read. Supported: ..., GlobalContext, ...", naming as
    supported the very module the model has."""
    model = timm.create_model("gcresnet33ts", num_classes=5).eval()
    assert all(m.mlp_scale is None for m in model.modules() if type(m).__name__ == "GlobalContext")
    with pytest.raises(vx.UnsupportedMethodError, match=r"its GlobalContext modules scale by no gate") as info:
        vx.Explainer(model).explain(torch.randn(1, 3, 64, 64), method="channel")
    assert "gradcam" in str(info.value)


def test_running_out_of_memory_is_not_taken_for_an_input_size():
    """A CNN's failure on an input is probed with forwards of one image to name a size it takes; running out of
    memory says nothing about the size's shape, so it is raised as it came, after no probe forward."""
    model = torchvision.models.resnet18(num_classes=5).eval()
    forwards = []

    def out_of_memory(module, inputs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    handles = [model.layer3.register_forward_pre_hook(out_of_memory),
               model.layer1.register_forward_pre_hook(lambda module, inputs: forwards.append(1))]
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError, match="simulated"):
            vx.Explainer(model).explain(torch.randn(1, 3, 33, 47), method="gradcam")
    finally:
        for handle in handles:
            handle.remove()
    assert len(forwards) == 1  # the explained forward only


def test_a_label_target_may_be_one_of_the_names_a_class_lists():
    """timm's ImageNet label names list synonyms ('goldfish, Carassius auratus'): target='goldfish' was refused
    as an unknown label, with all 1000 names in the message. One synonym names its class; a synonym two classes
    share is refused with both; an unknown name gets the close ones, not the whole list."""
    model = timm.create_model("resnet10t").eval()
    ex = vx.Explainer(model)
    names = ex.adapter.label_names
    assert names[1].startswith("goldfish, ")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    e = ex.explain(x, method="gradcam", target=["goldfish", "Carassius auratus"])
    assert e.targets.tolist() == [1, 1]
    torch.testing.assert_close(e.maps, ex.explain(x, method="gradcam", target=1).maps)
    shared = [i for i, n in enumerate(names) if "crane" in [s.strip() for s in n.split(",")]]
    assert len(shared) == 2  # the bird and the machine
    with pytest.raises(vx.TargetError, match=re.escape(f"'crane' names several classes {shared}")):
        ex.explain(x, method="gradcam", target="crane")
    with pytest.raises(vx.TargetError, match=r"unknown label 'goldfsh'.*goldfish") as info:
        ex.explain(x, method="gradcam", target="goldfsh")
    assert len(str(info.value)) < 600


def test_the_command_line_target_may_be_one_of_the_names_a_class_lists(tmp_path):
    """`vitexplain export --target goldfish` on a timm CNN with ImageNet's names explains class 1 (it was refused as
    an unknown label, as the Python API refused target='goldfish')."""
    import json

    import numpy as np
    from PIL import Image

    from vitexplain import cli

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    out = tmp_path / "out"
    assert cli.main(["export", str(tmp_path / "a.png"), "--out", str(out), "--model", "resnet10t", "--target",
                     "goldfish", "--method", "gradcam", "-q"]) == 0
    record = json.loads((out / "manifest.jsonl").read_text().splitlines()[0])
    assert record["target"]["index"] == 1 and record["target"]["label"].startswith("goldfish")


def test_the_size_probes_leave_a_model_in_training_mode_as_found():
    """The probe forwards that find a size a CNN takes run the user's model: one in training mode (batch-norm
    statistics updated by every forward), in channels_last, with a frozen layer, is left exactly as found."""
    torch.manual_seed(0)
    model = timm.create_model("dla46_c", num_classes=5).train().to(memory_format=torch.channels_last)
    model.base_layer.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [(m.training, p.requires_grad) for m in model.modules() for p in m.parameters(recurse=False)]
    with pytest.warns(UserWarning, match="training mode"):
        with pytest.raises(vx.InputError, match="runs on 64x96 images"):
            vx.Explainer(model).explain(torch.randn(2, 3, 67, 91), method="gradcam")
    after = model.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert [(m.training, p.requires_grad) for m in model.modules() for p in m.parameters(recurse=False)] == flags
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in model.parameters() if p.dim() == 4)
    assert _hooks(model) == 0 and all(p.grad is None for p in model.parameters())


def test_a_channels_last_stage_whose_side_equals_its_channels_is_read_channels_last():
    """MambaOut's stages output (B, h, w, C) (timm: output_fmt 'NHWC'); the package told the layout from the
    shape only, so at 192 x 192 its first stage, (B, 48, 48, 48) with 48 channels, was read as (B, C, h, w)
    and Grad-CAM there was another map (silently; off by 100% of its largest value). Oracle: the formula by
    hand on the stage's output permuted to (B, C, h, w)."""
    torch.manual_seed(0)
    model = timm.create_model("mambaout_femto", num_classes=5).eval()
    x = torch.randn(2, 3, 192, 192, generator=torch.Generator().manual_seed(1))
    classes = torch.tensor([1, 2])
    e = vx.Explainer(model).explain(x, method="gradcam", module="stages.0", target=classes)
    store = {}
    handle = model.stages[0].register_forward_hook(lambda m, i, o: store.__setitem__("a", o))
    try:
        score = model(x)[torch.arange(2), classes].sum()
    finally:
        handle.remove()
    assert store["a"].shape == (2, 48, 48, 48)
    (g,) = torch.autograd.grad(score, store["a"])
    a, g = store["a"].detach().permute(0, 3, 1, 2), g.permute(0, 3, 1, 2)
    want = (g.mean((2, 3), keepdim=True) * a).sum(1).clamp(min=0)
    assert want.max() > 0
    torch.testing.assert_close(e.maps, want, rtol=1e-5, atol=1e-6 * float(want.max()))


@pytest.mark.parametrize("module, channels_last", [("stages.1.blocks.0", True), ("stages.1.downsample.conv", False)])
def test_a_module_of_a_channels_last_model_is_read_in_its_own_layout(module, channels_last):
    """Inside MambaOut (output_fmt 'NHWC') a block outputs (B, h, w, C) and its convolutions (B, C, h, w); a
    module other than a stage was always read as (B, C, h, w), so Grad-CAM on a block was a (B, w, C) map of
    the wrong axes (silently)."""
    torch.manual_seed(0)
    model = timm.create_model("mambaout_femto", num_classes=5).eval()
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(1))
    classes = torch.tensor([1, 2])
    e = vx.Explainer(model).explain(x, method="gradcam", module=module, target=classes)
    store = {}
    handle = model.get_submodule(module).register_forward_hook(lambda m, i, o: store.__setitem__("a", o))
    try:
        score = model(x)[torch.arange(2), classes].sum()
    finally:
        handle.remove()
    (g,) = torch.autograd.grad(score, store["a"])
    a = store["a"].detach()
    if channels_last:
        a, g = a.permute(0, 3, 1, 2), g.permute(0, 3, 1, 2)
    assert a.shape[-2:] == (8, 12)  # the map of a stride-8 module on a 64 x 96 image
    want = (g.mean((2, 3), keepdim=True) * a).sum(1).clamp(min=0)
    assert want.max() > 0
    torch.testing.assert_close(e.maps, want, rtol=1e-5, atol=1e-6 * float(want.max()))
