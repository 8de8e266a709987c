"""Hugging Face ViT classifiers: methods against oracles built from the model's own eager attentions."""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
from hf_helpers import eager_oracle, sharpen_attention

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8, num_labels=4,
    )
    m = transformers.ViTForImageClassification(config).eval()
    sharpen_attention(m)
    return m


def test_hf_vit_rollout_generic_cdam_legrad(model):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ex = vx.Explainer(model)
    assert ex.family == "vit"
    results = {e.method: e for e in ex.explain(x, method=["rollout", "generic", "cdam", "legrad", "cdam_integrated"])}
    for i in range(2):
        target = results["generic"].targets[i].item()
        attn, grads, (t, dt) = eager_oracle(model, x[i], lambda out: out.logits[:, target], ex.adapter.norm1)
        torch.testing.assert_close(results["cdam"].maps[i], (t * dt).sum(-1)[1:].reshape(4, 4), atol=1e-5, rtol=1e-4)
        eye = torch.eye(17)
        r = eye.clone()
        for a in attn:
            m = 0.5 * a.mean(0) + 0.5 * eye
            r = (m / m.sum(-1, keepdim=True)) @ r
        torch.testing.assert_close(results["rollout"].maps[i], r[0, 1:].reshape(4, 4), atol=1e-5, rtol=1e-4)
        r = eye.clone()
        for a, g in zip(attn, grads):
            r = r + (g * a).clamp(min=0).mean(0) @ r
        torch.testing.assert_close(results["generic"].maps[i], r[0, 1:].reshape(4, 4), atol=1e-5, rtol=1e-4)
    for name in ("legrad", "cdam_integrated"):
        assert results[name].maps.shape == (2, 4, 4) and torch.isfinite(results[name].maps).all()
