"""ViT methods against hand-written oracles.

Every oracle below runs a deep copy of the model in eager attention (``fused_attn=False``),
one image at a time, reads the probabilities and their gradients from hooks on the
attention dropout, and writes the method's formula out with plain loops. No vitexplain code
is used in an oracle.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import vitexplain as vx
from vitexplain.errors import TargetError, UnsupportedMethodError

import timm  # noqa: E402,F401  (a dependency of the package: never skipped)
from timm.models.deit import VisionTransformerDistilled  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

CFG = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=6)
GRID = (4, 4)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(1)
    m = VisionTransformer(**CFG).eval()
    # random init gives near-uniform attention; sharpen it so the maps have structure
    with torch.no_grad():
        for blk in m.blocks:
            blk.attn.qkv.weight.mul_(4.0)
    return m


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))


class Eager:
    """One image through an eager copy: attentions with grads, tokens T = last norm1 output."""

    def __init__(self, model: nn.Module, image: torch.Tensor, target: int):
        self.model = copy.deepcopy(model)
        self.attn: list[torch.Tensor] = []
        self.blocks_out: list[torch.Tensor] = []
        for blk in self.model.blocks:
            blk.attn.fused_attn = False
            blk.attn.attn_drop.register_forward_hook(self._keep_attn)
            blk.register_forward_hook(lambda m, a, o: self.blocks_out.append(o))
        self.model.blocks[-1].norm1.register_forward_hook(self._keep_tokens)
        self.x = image[None].clone().requires_grad_(True)
        self.logits = self.model(self.x)
        self.target = target
        self.logits[0, target].backward(retain_graph=True)

    def _keep_attn(self, module, args, out):
        out.retain_grad()
        self.attn.append(out)

    def _keep_tokens(self, module, args, out):
        out.retain_grad()
        self.tokens = out

    def A(self, l):  # (H, N, N)
        return self.attn[l][0].detach()

    def G(self, l):
        return self.attn[l].grad[0]


def rollout_oracle(mats: list[torch.Tensor], discard: float = 0.0) -> torch.Tensor:
    n = mats[0].shape[-1]
    eye = torch.eye(n)
    result = eye.clone()
    for fused in mats:
        fused = fused.clone()
        if discard > 0:
            flat = fused.flatten()
            k = int(flat.numel() * discard)
            order = torch.argsort(flat, stable=True)[:k]
            for idx in order.tolist():
                if idx != 0:
                    flat[idx] = 0.0
            fused = flat.view(n, n)
        a = 0.5 * fused + 0.5 * eye
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result
    return result[0, 1:].reshape(GRID)


def oracle(name: str, model: nn.Module, image: torch.Tensor, target: int, **opts) -> torch.Tensor:
    e = Eager(model, image, target)
    L = len(e.attn)
    if name == "raw":
        return e.A(-1)[:, 0, 1:].mean(0).reshape(GRID)
    if name == "rollout":
        return rollout_oracle([e.A(l).mean(0) for l in range(L)], opts.get("discard_ratio", 0.0))
    if name == "grad_rollout":
        return rollout_oracle([(e.A(l) * e.G(l)).mean(0).clamp(min=0) for l in range(L)])
    if name == "generic":
        r = torch.eye(e.A(0).shape[-1])
        for l in range(L):
            abar = (e.G(l) * e.A(l)).clamp(min=0).mean(0)
            r = r + abar @ r
        return r[0, 1:].reshape(GRID)
    if name == "attn_gradcam":
        cam, grad = e.A(-1)[:, 0, 1:], e.G(-1)[:, 0, 1:]
        return (grad.mean(-1, keepdim=True) * cam).mean(0).clamp(min=0).reshape(GRID)
    if name == "gradcam":
        t, g = e.tokens[0, 1:].detach(), e.tokens.grad[0, 1:]
        return torch.relu((t * g.mean(0)).sum(-1)).reshape(GRID)
    if name == "cdam":
        return (e.tokens[0, 1:].detach() * e.tokens.grad[0, 1:]).sum(-1).reshape(GRID)
    if name == "legrad":
        total = torch.zeros(e.A(0).shape[-1])
        for l in range(L):
            s = e.model.forward_head(e.model.norm(e.blocks_out[l]))[0, target]
            (g,) = torch.autograd.grad(s, e.attn[l], retain_graph=True)
            total += torch.relu(g[0]).mean(dim=(0, 1))
        m = total[1:] / L
        return ((m - m.min()) / (m.max() - m.min())).reshape(GRID)
    if name == "occlusion":
        base = e.logits[0, target].item()
        out = torch.zeros(GRID)
        for i in range(GRID[0]):
            for j in range(GRID[1]):
                xo = image.clone()
                xo[:, i * 8 : (i + 1) * 8, j * 8 : (j + 1) * 8] = 0.0
                out[i, j] = base - model(xo[None])[0, target].item()
        return out
    if name == "integrated_gradients":
        steps = opts["steps"]
        nodes, weights = np.polynomial.legendre.leggauss(steps)
        alphas, w = (nodes + 1) / 2, weights / 2  # Gauss-Legendre on [0, 1], as captum's default
        total = torch.zeros_like(image)
        for a, wk in zip(alphas.tolist(), w.tolist()):
            xa = (a * image)[None].requires_grad_(True)
            (g,) = torch.autograd.grad(model(xa)[0, target], xa)
            total += wk * g[0]
        attr = (image * total).sum(0)
        return attr.reshape(GRID[0], 8, GRID[1], 8).sum(dim=(1, 3))
    raise KeyError(name)


ORACLE_METHODS = ["raw", "rollout", "grad_rollout", "generic", "attn_gradcam", "gradcam", "cdam", "legrad", "occlusion"]


@pytest.mark.parametrize("name", ORACLE_METHODS)
def test_method_matches_oracle_and_batch_of_4_equals_4_of_1(model, x, name):
    ex = vx.Explainer(model)
    e = ex.explain(x, method=name)
    assert e.maps.shape == (4, *GRID) and e.maps.dtype == torch.float32
    targets = e.targets.tolist()
    assert targets == model(x).argmax(1).tolist()
    for i in range(4):
        expected = oracle(name, model, x[i], targets[i])
        torch.testing.assert_close(e.maps[i], expected, atol=1e-4, rtol=1e-4)
        single = ex.explain(x[i : i + 1], method=name)
        torch.testing.assert_close(single.maps[0], e.maps[i], atol=1e-5, rtol=1e-4)


def test_rollout_discard_ratio_and_head_fusion(model, x):
    ex = vx.Explainer(model)
    e = ex.explain(x, method="rollout", discard_ratio=0.5)
    for i in range(4):
        expected = oracle("rollout", model, x[i], 0, discard_ratio=0.5)
        torch.testing.assert_close(e.maps[i], expected, atol=1e-5, rtol=1e-4)
    # max fusion through the public option equals a max-fused oracle for image 0
    e_max = ex.explain(x[:1], method="rollout", head_fusion="max")
    eager = Eager(model, x[0], 0)
    expected = rollout_oracle([eager.A(l).amax(0) for l in range(3)])
    torch.testing.assert_close(e_max.maps[0], expected, atol=1e-5, rtol=1e-4)


def test_raw_layer_and_head_selection(model, x):
    e = vx.Explainer(model).explain(x[:1], method="raw", layer=0, head=1)
    eager = Eager(model, x[0], 0)
    torch.testing.assert_close(e.maps[0], eager.A(0)[1, 0, 1:].reshape(GRID), atol=1e-6, rtol=0)


def test_integrated_gradients_is_captum_and_matches_oracle(model, x):
    e = vx.Explainer(model).explain(x[:2], method="integrated_gradients", steps=16)
    for i in range(2):
        expected = oracle("integrated_gradients", model, x[i], e.targets[i].item(), steps=16)
        torch.testing.assert_close(e.maps[i], expected, atol=1e-4, rtol=1e-3)


def test_smoothgrad_without_noise_is_saliency(model, x):
    e = vx.Explainer(model).explain(x[:2], method="smoothgrad", samples=1, noise=0.0)
    for i in range(2):
        xi = x[i : i + 1].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(model(xi)[0, e.targets[i]], xi)
        expected = g[0].abs().sum(0).reshape(4, 8, 4, 8).sum(dim=(1, 3))
        torch.testing.assert_close(e.maps[i], expected, atol=1e-5, rtol=1e-4)


def test_cdam_smooth_oracle_and_batch_invariance(model, x):
    ex = vx.Explainer(model)
    e = ex.explain(x, method="cdam_smooth", samples=5, noise=0.05, seed=3)
    # without noise every sample is the plain CDAM
    plain = ex.explain(x, method="cdam")
    no_noise = ex.explain(x, method="cdam_smooth", samples=3, noise=0.0)
    torch.testing.assert_close(no_noise.maps, plain.maps, atol=1e-5, rtol=1e-4)
    for i in range(4):
        torch.testing.assert_close(ex.explain(x[i : i + 1], method="cdam_smooth", samples=5, noise=0.05, seed=3).maps[0], e.maps[i], atol=1e-5, rtol=1e-4)
    # oracle for image 0: last block input + the same seeded noise, eager, one sample at a time
    eager = Eager(model, x[0], e.targets[0].item())
    inputs = []
    h = eager.model.blocks[-1].register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
    eager.model(x[:1])
    h.remove()
    xin = inputs[0].detach()
    eps = torch.randn(5, *xin.shape[1:], generator=torch.Generator().manual_seed(3))
    sigma = 0.05 * (xin.max() - xin.min())
    maps = []
    for s in range(5):
        tokens = []
        hh = eager.model.blocks[-1].norm1.register_forward_hook(lambda m, a, o: tokens.append(o))
        out = eager.model.forward_head(eager.model.norm(eager.model.blocks[-1](xin + sigma * eps[s])))
        hh.remove()
        (g,) = torch.autograd.grad(out[0, e.targets[0]], tokens[0])
        maps.append((tokens[0] * g).sum(-1)[0, 1:])
    torch.testing.assert_close(e.maps[0], torch.stack(maps).mean(0).reshape(GRID), atol=1e-5, rtol=1e-4)


def test_cdam_integrated_completeness():
    """Sum over all tokens of integrated CDAM ~ y(x) - y(T' = 0), within 5% at 64 steps.

    A model without prefix tokens (average pooling) puts every token on the map, so the
    map's sum is the sum over all tokens.
    """
    torch.manual_seed(4)
    m = VisionTransformer(**CFG, class_token=False, global_pool="avg").eval()
    with torch.no_grad():
        for blk in m.blocks:
            blk.attn.qkv.weight.mul_(4.0)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    ex = vx.Explainer(m)
    e = ex.explain(x, method="cdam_integrated", steps=64)
    zero = m.blocks[-1].norm1.register_forward_hook(lambda mod, a, o: torch.zeros_like(o))
    with torch.no_grad():
        y0 = m(x).gather(1, e.targets[:, None])[:, 0]
    zero.remove()
    with torch.no_grad():
        y = m(x).gather(1, e.targets[:, None])[:, 0]
    total = e.maps.flatten(1).sum(1)
    assert torch.all((total - (y - y0)).abs() <= 0.05 * (y - y0).abs()), (total, y - y0)
    for i in range(4):
        single = ex.explain(x[i : i + 1], method="cdam_integrated", steps=64)
        torch.testing.assert_close(single.maps[0], e.maps[i], atol=1e-5, rtol=1e-4)


class CountAttention(TorchFunctionMode):
    """Counts fused SDPA calls and, inside the model's blocks, 4-D softmax (eager attention)
    calls, independently of vitexplain. (vitexplain's own float32 recompute outside the
    model's forward is not eager attention and is not counted.)"""

    def __init__(self, model=None):
        super().__init__()
        self.sdpa = self.softmax = 0
        self.depth = 0
        self.handles = []
        if model is not None:
            for blk in model.blocks:
                self.handles.append(blk.register_forward_pre_hook(lambda *a: self._enter()))
                self.handles.append(blk.register_forward_hook(lambda *a: self._leave()))

    def _enter(self):
        self.depth += 1

    def _leave(self):
        self.depth -= 1

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.sdpa += 1
        if func in (torch.softmax, torch.Tensor.softmax, F.softmax) and args and args[0].dim() == 4 and self.depth:
            self.softmax += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("mode", ["fused", "auto"])
@pytest.mark.parametrize("name", vx.methods.names("vit"))
def test_every_method_keeps_fused_attention_and_leaves_model_as_found(model, x, name, mode):
    """The model's attention never switches to eager code; under ``auto`` on a CPU, methods that
    read every layer let the capture compute attention once instead of calling the kernel
    (docs/methods.md, attention_mode), the others keep the fused kernel."""
    flags = [blk.attn.fused_attn for blk in model.blocks]
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    opts = {"samples": 2} if name in ("cdam_smooth", "smoothgrad") else {"steps": 4} if name in ("cdam_integrated", "integrated_gradients") else {}
    with CountAttention(model) as counter:
        e = vx.Explainer(model, attention_mode=mode).explain(x[:2], method=name, **opts)
    spec = vx.methods.get(name, "vit")
    computed_once = mode == "auto" and spec.dense_attention and not spec.grads
    assert (counter.sdpa == 0) if computed_once else (counter.sdpa >= 3 and counter.softmax == 0)
    assert [blk.attn.fused_attn for blk in model.blocks] == flags
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] == hooks
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    # maps on the patch grid, or at the input's pixels for the pixel-resolution LRP methods;
    # either way the shape e.layout says
    expected = tuple(x.shape[-2:]) if name in ("attnlrp", "cp_lrp") else GRID
    assert torch.isfinite(e.maps).all() and e.maps.shape == (2, *expected) and e.layout.grid == expected


def test_several_methods_share_one_pass(model, x):
    ex = vx.Explainer(model)
    calls = []
    handle = model.blocks[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        results = ex.explain(x, method=["rollout", "cdam", "generic"], rollout={"discard_ratio": 0.2})
    finally:
        handle.remove()
    assert len(calls) == 1, "one forward for all three methods"
    assert [r.method for r in results] == ["rollout", "cdam", "generic"]
    torch.testing.assert_close(results[1].maps, ex.explain(x, method="cdam").maps)
    torch.testing.assert_close(results[0].maps, ex.explain(x, method="rollout", discard_ratio=0.2).maps)
    assert results[1].signed and not results[0].signed


def test_targets(model, x):
    ex = vx.Explainer(model)
    logits = model(x)
    assert ex.explain(x, method="cdam", target=2).targets.tolist() == [2, 2, 2, 2]
    assert ex.explain(x, method="cdam", target=[0, 1, 2, 3]).targets.tolist() == [0, 1, 2, 3]
    assert ex.explain(x, method="cdam", target=torch.tensor([5, 4, 3, 2])).targets.tolist() == [5, 4, 3, 2]
    per_class = ex.explain(x, method="cdam", target=3)
    by_callable = ex.explain(x, method="cdam", target=lambda out: out[:, 3])
    torch.testing.assert_close(per_class.maps, by_callable.maps)
    assert by_callable.targets.tolist() == [-1] * 4
    # label names from pretrained_cfg
    named = copy.deepcopy(model)
    named.pretrained_cfg = {"label_names": ["a", "b", "c", "d", "e", "f"]}
    e = vx.Explainer(named).explain(x, method="cdam", target="d")
    assert e.targets.tolist() == [3] * 4 and e.target_names() == ["d"] * 4
    with pytest.raises(TargetError, match="out of range.*6 classes"):
        ex.explain(x, method="cdam", target=6)
    with pytest.raises(TargetError, match="unknown label 'z'"):
        vx.Explainer(named).explain(x, method="cdam", target="z")
    with pytest.raises(TargetError, match="3 targets for a batch of 4"):
        ex.explain(x, method="cdam", target=[1, 2, 3])
    assert ex.explain(x, method="cdam").targets.tolist() == logits.argmax(1).tolist()


def test_unknown_method_and_options_errors(model, x):
    ex = vx.Explainer(model)
    with pytest.raises(UnsupportedMethodError, match=r"unknown method 'nope'.*methods that apply.*'rollout'"):
        ex.explain(x, method="nope")
    with pytest.raises(TypeError, match="per method"):
        ex.explain(x, method=["rollout", "cdam"], discard_ratio=0.5)


@pytest.mark.parametrize(
    "factory, size, grid",
    [
        (lambda: VisionTransformer(**{**CFG, "depth": 2}, reg_tokens=3), (32, 32), (4, 4)),
        (lambda: VisionTransformerDistilled(**{**CFG, "depth": 2}), (32, 32), (4, 4)),
        (lambda: VisionTransformer(**{**CFG, "depth": 2}, class_token=False, global_pool="avg"), (32, 32), (4, 4)),
        (lambda: VisionTransformer(**{**CFG, "depth": 2}, dynamic_img_size=True), (48, 24), (6, 3)),
    ],
)
def test_layout_variants_give_maps_on_the_right_grid(factory, size, grid):
    m = factory().eval()
    x = torch.randn(2, 3, *size)
    for e in vx.Explainer(m).explain(x, method=["raw", "rollout", "generic", "cdam", "gradcam", "legrad"]):
        assert e.maps.shape == (2, *grid), e.method
        assert torch.isfinite(e.maps).all()


def test_avg_pool_raw_attention_is_the_mean_over_patch_queries():
    m = VisionTransformer(**{**CFG, "depth": 1}, class_token=False, global_pool="avg").eval()
    x = torch.randn(1, 3, 32, 32)
    e = vx.Explainer(m).explain(x, method="raw")
    eager = copy.deepcopy(m)
    eager.blocks[0].attn.fused_attn = False
    kept = []
    eager.blocks[0].attn.attn_drop.register_forward_hook(lambda mod, a, o: kept.append(o))
    eager(x)
    expected = kept[0][0].mean(0).mean(0).reshape(GRID)  # mean over heads, then over all queries
    torch.testing.assert_close(e.maps[0], expected, atol=1e-6, rtol=1e-5)


def test_a_method_of_another_family_is_refused_by_name(model, x):
    """A CNN gate method on a ViT: refused with the methods that do apply (not any error)."""
    with pytest.raises(UnsupportedMethodError, match=r"method 'spatial' is for cnn models; .* is a vit model.*Methods that apply") as err:
        vx.Explainer(model).explain(x[:1], method="spatial")
    for name in ("rollout", "cdam", "generic"):
        assert repr(name) in str(err.value)


def test_windowed_swin_is_explained_by_its_own_family():
    # one stage (no patch merging): rollout through shifted windows is a distribution over the
    # patch grid; the windowed methods are tested against dense oracles in tests/test_swin.py
    from timm.models.swin_transformer import SwinTransformer

    swin = SwinTransformer(img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(2,), num_heads=(2,), num_classes=3).eval()
    ex = vx.Explainer(swin)
    assert ex.family == "swin"
    maps = ex.explain(torch.randn(1, 3, 32, 32), method="rollout").maps
    assert maps.shape == (1, 16, 16)
    torch.testing.assert_close(maps.sum(), torch.tensor(1.0), rtol=0, atol=1e-5)


def test_torchvision_vit_methods_match_timm_style_oracle():
    import torchvision as tv
    torch.manual_seed(0)
    m = tv.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=4).eval()
    x = torch.randn(2, 3, 32, 32)
    ex = vx.Explainer(m)
    rollout, cdam = ex.explain(x, method=["rollout", "cdam"])
    for i in range(2):
        # eager oracle from MHA need_weights=True on each block's recorded input
        inputs, tokens = [], []
        hooks = [blk.self_attention.register_forward_pre_hook(lambda mod, a: inputs.append(a[0])) for blk in m.encoder.layers]
        hooks.append(m.encoder.layers[-1].ln_1.register_forward_hook(lambda mod, a, o: (o.retain_grad(), tokens.append(o))[0]))
        out = m(x[i : i + 1])
        out[0, cdam.targets[i]].backward()
        for h in hooks:
            h.remove()
        mats = []
        for blk, inp in zip(m.encoder.layers, inputs):
            _, w = blk.self_attention(inp, inp, inp, need_weights=True, average_attn_weights=False)
            mats.append(w[0].detach().mean(0))
        expected = rollout_oracle(mats)
        torch.testing.assert_close(rollout.maps[i], expected, atol=1e-5, rtol=1e-4)
        expected_cdam = (tokens[0] * tokens[0].grad)[0, 1:].sum(-1).reshape(GRID).detach()
        torch.testing.assert_close(cdam.maps[i], expected_cdam, atol=1e-5, rtol=1e-4)


def test_explain_images_applies_model_preprocessing(tmp_path, model):
    from PIL import Image

    rng = np.random.default_rng(0)
    paths = []
    for i, shape in enumerate([(40, 50), (32, 32)]):
        p = tmp_path / f"img {i}.png"
        Image.fromarray(rng.integers(0, 255, (*shape, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    ex = vx.Explainer(model)
    e = ex.explain([str(p) for p in paths], method="cdam")
    assert e.maps.shape == (2, *GRID)
    assert len(e.images) == 2 and e.images[0].shape == (32, 32, 3) and e.images[0].dtype == np.uint8
    rgb = e.overlay(0)
    assert rgb.shape == (32, 32, 3) and rgb.dtype == np.uint8
    assert e.upsample().shape == (2, 32, 32)
