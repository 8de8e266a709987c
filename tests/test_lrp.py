"""attnlrp and cp_lrp: conservation, fused == eager, batching, isolation from other models, refusals.

The equality with lxt (the authors' implementation) is in tests/test_lrp_lxt.py; the pointing
floor on the shapes zoo model in tests/test_lrp_pointing.py.
"""

from __future__ import annotations

import copy
import threading

import pytest
import timm
import torch
from torch import nn

import vitexplain as vx
from vitexplain.errors import UnsupportedMethodError, UnsupportedModelError


class _BiasFree(nn.Module):
    """A one-block transformer without biases or additive constants: LRP must conserve exactly.

    Patch conv -> LayerNorm (no bias) -> nn.MultiheadAttention (no bias) + residual -> LayerNorm ->
    Linear -> GELU -> Linear + residual -> mean over tokens -> Linear head. With q and k detached
    (CP-LRP) every step is conservative, so the pixel relevance sums to the logit.
    """

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 4, stride=4, bias=False)
        self.norm1 = nn.LayerNorm(dim, bias=False)
        self.attn = nn.MultiheadAttention(dim, 2, bias=False, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, bias=False)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)
        self.head = nn.Linear(dim, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)
        h = self.norm1(t)
        t = t + self.attn(h, h, h, need_weights=False)[0]
        t = t + self.fc2(nn.functional.gelu(self.fc1(self.norm2(t))))
        return self.head(t.mean(1))


def _relevance(model: nn.Module, x: torch.Tensor, method: str, target, attention: bool = True, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Our relevance through the public context, for a model without an adapter."""
    from vitexplain.methods.context import Context
    from vitexplain.methods.lrp import lrp_relevance
    from vitexplain.targets import resolve

    class _Adapter:
        def __init__(self, m):
            self.model = m

        def forward(self, inp):
            return self.model(inp)

    with torch.no_grad():
        outputs = model(x)
    ctx = Context(_Adapter(model), x, outputs, resolve(target, outputs, None), None, method=method)
    variant = "cp" if method == "cp_lrp" else "attnlrp"
    return lrp_relevance(ctx, variant, attention=attention, **options)


@pytest.mark.parametrize("options", [{}, {"linear_gamma": 0.25}, {"conv_gamma": 0.5, "linear_gamma": 0.1}])
def test_cp_lrp_conserves_exactly_without_biases(options):
    torch.manual_seed(3)
    model = _BiasFree().eval()
    x = torch.randn(2, 3, 16, 16)
    relevance, score = _relevance(model, x, "cp_lrp", [0, 2], **options)
    # independent expectation: the logits themselves, read off the plain model
    logits = model(x).detach()
    assert torch.allclose(score, logits[[0, 1], [0, 2]])
    assert torch.allclose(relevance.flatten(1).sum(1), score, rtol=1e-4, atol=1e-6)


def test_attnlrp_shares_relevance_through_attention_unlike_cp():
    """AttnLRP also sends relevance through q and k (the softmax), so it differs from CP-LRP, and its
    relevance is not conserved exactly there (the softmax's bias term), while CP-LRP's is."""
    torch.manual_seed(4)
    model = _BiasFree().eval()
    with torch.no_grad():
        model.attn.in_proj_weight[:32].mul_(4.0)  # sharper attention
    x = torch.randn(1, 3, 16, 16)
    attn, score = _relevance(model, x, "attnlrp", 1)
    cp, _ = _relevance(model, x, "cp_lrp", 1)
    assert float((attn - cp).abs().max()) > 1e-3 * float(cp.abs().max())
    assert torch.allclose(cp.sum(), score.sum(), rtol=1e-4)


def _timm_vit(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=4, **kwargs).eval()


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_fused_attention_equals_attention_computed_in_python(method):
    """SDPA's rule (gradient x 1/4, 1/4, 1/2 at q, k, v; or q, k detached) and the rule on eager
    attention (the uniform rule at both matmuls; or the weights detached) give the same relevance."""
    model = _timm_vit()
    eager = copy.deepcopy(model)
    for module in eager.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = False
    x = torch.randn(2, 3, 32, 32)
    a = vx.Explainer(model).explain(x, method=method, target=[1, 3]).maps
    b = vx.Explainer(eager).explain(x, method=method, target=[1, 3]).maps
    assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())


def test_maps_are_pixels_and_the_grid_sums_them():
    model = vx.zoo.load("shapes-vit")
    batch = vx.data.shapes(3, seed=10_300)
    ex = vx.Explainer(model)
    e = ex.explain(batch.tensor, method="attnlrp")
    size = tuple(batch.tensor.shape[-2:])
    grid = ex.adapter.layout(size).grid  # the model's patch grid; e.layout describes the pixel map
    assert e.maps.shape == (3, *size) and e.signed and e.layout.grid == size
    assert torch.equal(e.maps, e.extras["pixels"])
    assert e.extras["grid"].shape == (3, *grid)
    assert torch.allclose(e.extras["grid"].flatten(1).sum(1), e.maps.flatten(1).sum(1), rtol=1e-4)
    ph, pw = size[0] // grid[0], size[1] // grid[1]
    cell = e.maps[:, :ph, pw : 2 * pw].sum(dim=(1, 2))  # patch (0, 1), summed by hand
    assert torch.allclose(e.extras["grid"][:, 0, 1], cell, rtol=1e-4, atol=1e-6)
    patches = vx.Explainer(model).explain(batch.tensor, method="attnlrp", resolution="patches")
    assert torch.allclose(patches.maps, e.extras["grid"])
    # with another method in the same call attnlrp runs its own forward: the same maps
    both = vx.Explainer(model).explain(batch.tensor, method=["generic", "attnlrp"])[1]
    assert torch.allclose(both.maps, e.maps, rtol=1e-5, atol=1e-6 * float(e.maps.abs().max()))


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_a_batch_equals_its_images_one_by_one(method):
    model = vx.zoo.load("shapes-vit")
    x = vx.data.shapes(4, seed=10_400).tensor
    ex = vx.Explainer(model)
    whole = ex.explain(x, method=method, target=[0, 1, 2, 3]).maps
    alone = torch.cat([ex.explain(x[i : i + 1], method=method, target=i).maps for i in range(4)])
    assert float((whole - alone).abs().max()) <= 1e-5 * float(whole.abs().max())


def test_other_models_are_unaffected_during_and_after():
    """The rules live in a thread-local torch function mode: another model's generic and legrad maps,
    computed in another thread while attnlrp's forward is inside the mode, and afterwards, are unchanged."""
    lrp_model, other = vx.zoo.load("shapes-vit"), _timm_vit()
    x_other = torch.randn(2, 3, 32, 32)
    other_ex = vx.Explainer(other)
    before = {m: other_ex.explain(x_other, method=m).maps for m in ("generic", "legrad")}
    inside, release, during = threading.Event(), threading.Event(), {}

    def blocking_score(outputs):
        if torch.is_grad_enabled() and torch.overrides._get_current_function_mode_stack():
            inside.set()  # attnlrp's forward: the LRP mode is active in this thread
            release.wait(timeout=60)
        return outputs[:, 0]

    def compare():
        inside.wait(timeout=60)
        try:
            for m in before:
                during[m] = other_ex.explain(x_other, method=m).maps
        finally:
            release.set()

    thread = threading.Thread(target=compare)
    thread.start()
    e = vx.Explainer(lrp_model).explain(vx.data.shapes(2, seed=10_500).tensor, method="attnlrp", target=blocking_score)
    thread.join()
    assert inside.is_set() and e.maps.abs().sum() > 0
    for m in before:
        assert torch.equal(during[m], before[m]), m
        assert torch.equal(other_ex.explain(x_other, method=m).maps, before[m]), m


def test_plan_refuses_models_the_rules_do_not_cover():
    cnn = vx.Explainer(vx.zoo.load("shapes-cnn"))
    assert "attnlrp" not in cnn.methods()
    with pytest.raises(UnsupportedMethodError, match="attnlrp"):
        cnn.plan(method="attnlrp")
    xcit = vx.Explainer(timm.create_model("xcit_nano_12_p16_224", pretrained=False, img_size=32, num_classes=3).eval())
    with pytest.raises(UnsupportedMethodError, match="cross-covariance"):
        xcit.plan(method="cp_lrp")
    assert {"attnlrp", "cp_lrp"} <= set(vx.Explainer(_timm_vit()).methods())


def test_an_uncovered_softmax_raises_instead_of_returning_wrong_maps():
    model = _timm_vit()
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(UnsupportedModelError, match="softmax over dim"):
        vx.Explainer(model).explain(x, method="attnlrp", target=lambda out: out.softmax(-1)[:, 0])


def test_the_model_is_left_as_found_after_an_error():
    model = _timm_vit()
    flags = [p.requires_grad for p in model.parameters()]

    def failing(outputs):
        if torch.overrides._get_current_function_mode_stack():  # inside the LRP forward
            raise RuntimeError("boom")
        return outputs[:, 0]

    with pytest.raises(RuntimeError, match="boom"):
        vx.Explainer(model).explain(torch.randn(1, 3, 32, 32), method="attnlrp", target=failing)
    assert not torch.overrides._get_current_function_mode_stack()
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())


def test_explore_and_export_offer_the_pixel_maps(tmp_path):
    """The explorer page gets attnlrp's pixel maps (average-pooled to at most MAX_MAP_SIDE per side), the
    export command writes its overlays."""
    import json
    import re

    import numpy as np

    from vitexplain.cli import main
    from vitexplain.explorer.methods import MAX_MAP_SIDE

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=256, patch_size=32, depth=1,
                              num_classes=3).eval()
    image = (np.random.default_rng(0).random((256, 256, 3)) * 255).astype(np.uint8)
    page = vx.explore(model, image, tmp_path / "page.html", method=["attnlrp", "generic"], top_k=2)
    data = json.loads(re.search(r'id="vx-data">(.*?)</script>', page.read_text(), re.S).group(1))
    entries = {m["name"]: m for m in data["images"][0]["methods"]}
    assert entries["attnlrp"]["grid"] == [MAX_MAP_SIDE, MAX_MAP_SIDE] and entries["generic"]["grid"] == [8, 8]
    assert entries["attnlrp"]["maps"]["rows"] == 2 and entries["attnlrp"]["maps"]["cols"] == MAX_MAP_SIDE ** 2

    shapes = vx.data.shapes(1, seed=10_600)
    from PIL import Image

    Image.fromarray(np.asarray(shapes.images[0])).save(tmp_path / "a.png")
    assert main(["export", str(tmp_path / "a.png"), "--out", str(tmp_path / "out"), "--model", "shapes-vit",
                 "--method", "cp_lrp"]) == 0
    assert (tmp_path / "out" / "a.png.cp_lrp.png").exists()
