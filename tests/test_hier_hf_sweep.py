"""A sweep of Hugging Face hierarchical and windowed vision transformers (and timm builds at sizes other than their
default) at what the other files leave out: headless models built without a pooling layer, configs with
``return_dict=False``, non-square inputs and non-square configs, checked against the dense float64 oracles of
tests/hier_oracle.py, tests/test_swin.py, tests/test_hier.py, tests/test_hier_hf.py and tests/test_hier_hiera.py,
or against a peer model with the same weights whose maps those oracles check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitexplain as vx
from hf_helpers import perturb_norms
from hier_oracle import assert_matches_oracle, carry

transformers = pytest.importorskip("transformers")

_SWIN = dict(image_size=64, patch_size=4, window_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4])
_SWIN_CONFIGS = {"swin": "SwinConfig", "swinv2": "Swinv2Config", "donut": "DonutSwinConfig"}
_SWIN_MODELS = {"swin": "SwinModel", "swinv2": "Swinv2Model", "donut": "DonutSwinModel"}
DIRECTION = torch.randn(32, generator=torch.Generator().manual_seed(4))


def _gains(model: nn.Module) -> nn.Module:
    """Norms away from the identity (tests/hf_helpers.py), in eval mode."""
    perturb_norms(model, torch.Generator().manual_seed(1))
    return model.eval()


def _swin(kind: str, model_cls: str = "", config: dict = {}, **kwargs) -> nn.Module:  # noqa: B006 (never mutated)
    torch.manual_seed(0)
    cfg = getattr(transformers, _SWIN_CONFIGS[kind])(**_SWIN, **config)
    if kind == "swin":
        cfg._attn_implementation = "sdpa"
    return _gains(getattr(transformers, model_cls or _SWIN_MODELS[kind])(cfg, **kwargs))


def _score(pooled: torch.Tensor) -> torch.Tensor:
    return pooled @ DIRECTION


@pytest.mark.parametrize("kind", list(_SWIN_CONFIGS))
def test_a_headless_swin_without_a_pooling_layer_is_explained_as_the_one_with_its_parameter_free_pooler(kind):
    """SwinModel / Swinv2Model / DonutSwinModel(add_pooling_layer=False) return no pooler_output: every method the
    plan listed raised AttributeError ('NoneType' object has no attribute 'shape'). Their readout is the mean of
    the last tokens, which is what the pooler (AdaptiveAvgPool1d, no parameters) of the same model computes: the
    maps equal those of the pooled model with the same weights (whose maps tests/test_swin.py checks)."""
    pooled, bare = _swin(kind), _swin(kind, add_pooling_layer=False)
    bare.load_state_dict(pooled.state_dict(), strict=False)
    assert bare.pooler is None
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(2))
    ex, peer = vx.Explainer(bare), vx.Explainer(pooled)
    methods = ["rollout", "generic", "grad_rollout", "cdam", "gradcam", "legrad", "raw"]
    assert set(methods) <= set(ex.plan().available)
    for method, got, want in zip(methods, ex.explain(x, method=methods, target=_score),
                                 peer.explain(x, method=methods, target=_score)):
        assert got.maps.shape == want.maps.shape == (2, *got.layout.grid), method
        assert float(want.maps.abs().max()) > 0, method
        torch.testing.assert_close(got.maps, want.maps, atol=1e-6 * float(want.maps.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("kind, model_cls", [("swinv2", "Swinv2ForImageClassification"), ("swinv2", "Swinv2Model"),
                                             ("donut", "DonutSwinModel")])
def test_a_swin_whose_config_says_return_dict_false_is_explained_like_the_default(kind, model_cls):
    """A config with return_dict=False makes the model return tuples: the adapter read .logits / .pooler_output of
    one and raised AttributeError; it asks for the model's output object, so the maps are the default config's.
    (SwinModel / SwinForImageClassification with return_dict=False fail inside transformers 5 itself.)"""
    classifier = model_cls.endswith("Classification")
    extra = {"num_labels": 5} if classifier else {}
    default = _swin(kind, model_cls, extra)
    tuples = _swin(kind, model_cls, {**extra, "return_dict": False})
    tuples.load_state_dict(default.state_dict())
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    target = 1 if classifier else _score
    for got, want in zip(vx.Explainer(tuples).explain(x, method=["generic", "cdam"], target=target),
                         vx.Explainer(default).explain(x, method=["generic", "cdam"], target=target)):
        assert float(want.maps.abs().max()) > 0
        torch.testing.assert_close(got.maps, want.maps)


# -- non-square inputs and configs against the dense float64 oracles ------------------------------------------------
@pytest.mark.parametrize("kind", ["pvt", "pvt_linear", "segformer"])
def test_spatial_reduction_models_match_the_dense_oracle_on_a_non_square_input_whose_sides_no_stride_divides(
        kind, monkeypatch):
    """PVTv2 (conv and linear-mode keys) and SegFormer at 72 x 104: grids 18 x 26, 9 x 13, 5 x 7, 3 x 4 (odd sides,
    padded strided convs), rollout, generic and grad_rollout equal the dense float64 chain of tests/test_hier_hf.py."""
    import test_hier_hf as th

    monkeypatch.setattr(th, "SIZE", (72, 104))
    model = th.build(kind)
    x = torch.randn(2, 3, 72, 104, generator=torch.Generator().manual_seed(1))
    items, last = th.dense_chain(kind, model, x)
    assert last == (3, 4)
    u = torch.full((2, 12), 1.0 / 12, dtype=torch.float64)
    methods = ["rollout", "generic", "grad_rollout"]
    for method, e in zip(methods, vx.Explainer(model).explain(x, method=methods, target=1)):
        assert e.maps.shape == (2, 18, 26) == (2, *e.layout.grid), method
        assert_matches_oracle(e.maps, carry(items, u, method).view(e.maps.shape), (kind, method))


def _swin_oracle_errors(kind: str, model: nn.Module, x: torch.Tensor, cls: int = 2) -> dict:
    from test_swin import Oracle, fuse, rel_err

    oracle = Oracle(kind, model, x, cls)
    mean = lambda l: fuse(oracle.probs[l], "mean")  # noqa: E731
    chefer = lambda l: (oracle.grads[l] * oracle.probs[l]).clamp(min=0).mean(1)  # noqa: E731
    rollout, generic, raw = vx.Explainer(model).explain(x, method=["rollout", "generic", "raw"], target=cls)
    last = oracle.grids[oracle.stages[-1]]
    assert rollout.maps.shape == (x.shape[0], *oracle.grids[0]) == (x.shape[0], *rollout.layout.grid)
    assert raw.maps.shape == (x.shape[0], *last) == (x.shape[0], *raw.layout.grid)
    return {"rollout": rel_err(rollout.maps, oracle.chain(mean, "rollout")),
            "generic": rel_err(generic.maps, oracle.chain(chefer, "generic", deviation=True)),
            "raw": rel_err(raw.maps, mean(-1).mean(1).view(-1, *last))}


@pytest.mark.parametrize("kind", ["hf", "hf2", "hfdonut"])
def test_hugging_face_swins_match_the_dense_oracle_on_a_non_square_padded_input(kind):
    """Hugging Face Swin, SwinV2 and Donut's Swin at 72 x 104 (grids 18 x 26 and 9 x 13, windows of 4 zero-padded
    on both sides): rollout, generic and raw equal tests/test_swin.py's dense products of the eager windows."""
    from test_swin import build

    model = build(kind, (64, 64))
    x = torch.randn(2, 3, 72, 104, generator=torch.Generator().manual_seed(3))
    errors = _swin_oracle_errors(kind, model, x)
    assert max(errors.values()) < 1e-5, errors


def test_timm_swin_with_dynamic_img_size_matches_the_dense_oracle_on_a_non_square_input(monkeypatch):
    """A timm Swin built at 64 px with dynamic_img_size=True, explained at 48 x 80 (grids 12 x 20 and 6 x 10):
    the oracle's eager twin is the same dynamic build (fused attention off)."""
    import test_swin as ts
    from timm.models.swin_transformer import SwinTransformer

    def dynamic(kind: str, size=(64, 64), attn: str = "sdpa") -> nn.Module:
        torch.manual_seed(0)
        model = SwinTransformer(img_size=64, patch_size=4, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4),
                                num_classes=ts.CLASSES, dynamic_img_size=True)
        for module in model.modules():
            if hasattr(module, "fused_attn"):
                module.fused_attn = attn == "sdpa"
        with torch.no_grad():
            model.head.fc.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
        return _gains(model)

    monkeypatch.setattr(ts, "build", dynamic)
    x = torch.randn(2, 3, 48, 80, generator=torch.Generator().manual_seed(3))
    errors = _swin_oracle_errors("timm", dynamic("timm"), x)
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("head", [True, False], ids=["classifier", "headless"])
def test_hugging_face_hiera_with_a_non_square_config_matches_the_dense_oracle(head, monkeypatch):
    """HieraConfig(image_size=[64, 96]): a 16 x 24 grid of 4 x 6 mask units, unrolled by the model's own code."""
    import test_hier_hiera as th
    from test_hier_more import _reinit

    monkeypatch.setattr(th, "SIZE", (64, 96))
    torch.manual_seed(0)
    config = transformers.HieraConfig(
        image_size=[64, 96], embed_dim=16, num_heads=[1, 2, 4], depths=[1, 2, 2], num_query_pool=2,
        masked_unit_size=[4, 4], masked_unit_attention=[True, True, False], mlp_ratio=2.0, num_labels=5)
    model = _reinit(transformers.HieraForImageClassification(config) if head else transformers.HieraModel(config))
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(1))
    vector = th.VECTOR.float()
    items, u, order, grid = th.dense_chain(model, x, th._logit if head else th._score)
    assert grid == (16, 24)
    methods = ["rollout", "generic", "grad_rollout"]
    target = 1 if head else (lambda pooled: pooled @ vector)
    for method, e in zip(methods, vx.Explainer(model).explain(x, method=methods, target=target)):
        unrolled = carry(items, u, method)
        want = torch.zeros_like(unrolled)
        want[:, order] = unrolled
        assert e.maps.shape == (2, 16, 24) == (2, *e.layout.grid)
        assert_matches_oracle(e.maps, want.view(2, 16, 24), method)


def test_timm_pvt_v2_at_160_by_96_matches_the_dense_oracle(monkeypatch):
    """timm pvt_v2 (built for 224) at 160 x 96: grids 40 x 24 down to 5 x 3, spatial-reduction keys 5 x 3 at stage 0."""
    import test_hier as th

    monkeypatch.setattr(th, "SIZE", (160, 96))
    model = th.build("pvt")
    x = th.images()
    items, _ = th.dense_chain("pvt", model, x, 1)
    n = th._last_n(items)
    assert n == 15
    u = torch.full((2, n), 1.0 / n, dtype=torch.float64)
    methods = ["rollout", "generic", "grad_rollout"]
    for method, e in zip(methods, vx.Explainer(model).explain(x, method=methods, target=1)):
        assert e.maps.shape == (2, 40, 24) == (2, *e.layout.grid)
        assert_matches_oracle(e.maps, carry(items, u, method).view(e.maps.shape), method)


@pytest.mark.parametrize("model_cls", ["Dinov2WithRegistersForImageClassification", "Dinov2WithRegistersModel"])
def test_dinov2_with_registers_matches_its_eager_attention_on_a_non_square_input(model_cls):
    """DINOv2 with 2 registers at 32 x 48 (its position embeddings interpolated to 4 x 6): rollout, generic (class
    row of R - I, registers left out of the map) and CDAM equal the dense products of an eager copy's attention."""
    from hf_helpers import eager_oracle
    from test_families_hf import TINY, VECTOR, _build, _pooled

    head = model_cls.endswith("Classification")
    model = _build("Dinov2WithRegistersConfig", model_cls, num_register_tokens=2, **({"num_labels": 5} if head else {}))
    ex = vx.Explainer(model)
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(1))
    target = 1 if head else vx.targets.similarity(VECTOR)
    rollout, generic, cdam = ex.explain(x, method=["rollout", "generic", "cdam"], target=target)
    assert rollout.layout.grid == (4, 6) and rollout.layout.num_prefix_tokens == 3 and TINY["patch_size"] == 8
    score = (lambda out: out.logits[:, 1]) if head else (
        lambda out: torch.cosine_similarity(_pooled(out), VECTOR[None], dim=-1))
    for i in range(2):
        attn, grads, (t, dt) = eager_oracle(model, x[i], score, ex.adapter.norm1)
        n = attn[0].shape[-1]
        eye, v = torch.eye(n), torch.zeros(n)
        v[0] = 1.0
        r = eye.clone()
        for a in attn:
            m = 0.5 * a.mean(0) + 0.5 * eye
            r = (m / m.sum(-1, keepdim=True)) @ r
        torch.testing.assert_close(rollout.maps[i], (v @ r)[3:].view(4, 6), atol=1e-6, rtol=1e-4)
        r = eye.clone()
        for a, g in zip(attn, grads):
            r = r + (g * a).clamp(min=0).mean(0) @ r
        want = (v @ (r - eye))[3:].view(4, 6)
        assert float(want.abs().max()) > 0
        torch.testing.assert_close(generic.maps[i], want, atol=1e-6 * float(want.abs().max()), rtol=1e-4)
        torch.testing.assert_close(cdam.maps[i], (t * dt).sum(-1)[3:].view(4, 6), atol=1e-6, rtol=1e-4)


# -- classifiers built with num_labels=0 -----------------------------------------------------------------------------
_SR = dict(image_size=64, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 2, 4])
_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)
_NO_LABELS = {
    "SwinForImageClassification": ("SwinConfig", _SWIN),
    "Swinv2ForImageClassification": ("Swinv2Config", _SWIN),
    "PvtV2ForImageClassification": ("PvtV2Config", _SR),
    "PvtForImageClassification": ("PvtConfig", _SR),
    "ViTForImageClassification": ("ViTConfig", _VIT),
    "Dinov2WithRegistersForImageClassification": ("Dinov2WithRegistersConfig", {**_VIT, "num_register_tokens": 2}),
    "DeiTForImageClassificationWithTeacher": ("DeiTConfig", _VIT),
}


@pytest.mark.parametrize("model_cls", list(_NO_LABELS))
def test_a_classifier_built_with_num_labels_0_is_headless_and_refuses_a_class_target(model_cls):
    """With num_labels=0 a Hugging Face classifier's head is nn.Identity and its "logits" are the pooled features:
    Swin, SwinV2, PVT, PVTv2, ViT, DINOv2 and DeiT adapters said it had a head, so target=None explained the largest
    feature channel as the "predicted class" (and target=3 channel 3). It is a headless model now (as Hiera's and
    LeViT's adapters already said): a class target is refused, a score of the features is explained."""
    config_cls, config = _NO_LABELS[model_cls]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config, num_labels=0)).eval()
    size = config["image_size"]
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    ex = vx.Explainer(model)
    assert not ex.adapter.has_head and ex.adapter.label_names is None
    for target in (None, 3):
        with pytest.raises(vx.TargetError, match="no classifier head"):
            ex.explain(x, method="generic", target=target)
    e = ex.explain(x, method="generic", target=vx.targets.norm())
    assert e.maps.shape == (2, *e.layout.grid) and float(e.maps.abs().max()) > 0
