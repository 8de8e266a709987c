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
from hier_oracle import assert_matches_oracle, carry

transformers = pytest.importorskip("transformers")

_SWIN = dict(image_size=64, patch_size=4, window_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4])
_SWIN_CONFIGS = {"swin": "SwinConfig", "swinv2": "Swinv2Config", "donut": "DonutSwinConfig"}
_SWIN_MODELS = {"swin": "SwinModel", "swinv2": "Swinv2Model", "donut": "DonutSwinModel"}
DIRECTION = torch.randn(32, generator=torch.Generator().manual_seed(4))


def _gains(model: nn.Module) -> nn.Module:
    """Norms away from the identity (random-init gradients through Swin's norms are otherwise near zero)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm) and module.weight is not None:
                module.weight.normal_(1.0, 0.2, generator=generator)
                module.bias.normal_(0.0, 0.2, generator=generator)
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
