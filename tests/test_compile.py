"""``torch.compile``: capture and explain a compiled model without recompiling it.

vitexplain unwraps the ``OptimizedModule`` and runs the original module eagerly inside the
capture scope (compiler stance ``force_eager``), so every attention call is seen and the maps
equal the uncompiled model's. A backend that counts its invocations shows that nothing is
compiled by explaining, and that the compiler works as before once the scope ends.
"""

from __future__ import annotations

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitexplain as vx

METHODS = ["rollout", "generic", "cdam", "legrad", "cdam_smooth"]


@pytest.fixture()
def compiled():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5).eval()
    compiles = {"n": 0}

    def backend(gm, example_inputs):
        compiles["n"] += 1
        return gm.forward

    return model, torch.compile(model, backend=backend), compiles


def test_explain_compiled_equals_uncompiled_without_recompiling(compiled):
    model, opt, compiles = compiled
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected_logits = model(x)
        torch.testing.assert_close(opt(x), expected_logits)
    assert compiles["n"] == 1
    ex, ref = vx.Explainer(opt), vx.Explainer(model)
    assert ex.methods() == ref.methods()
    for _ in range(2):  # repeated calls: no compile at all
        for got, want in zip(ex.explain(x, method=METHODS, cdam_smooth={"samples": 4}), ref.explain(x, method=METHODS, cdam_smooth={"samples": 4})):
            torch.testing.assert_close(got.maps, want.maps, atol=1e-5, rtol=0)
    assert compiles["n"] == 1
    with torch.no_grad():  # the compiled code is still used, unchanged
        torch.testing.assert_close(opt(x), expected_logits)
    assert compiles["n"] == 1


def test_capture_compiled_records_every_layer_and_restores_the_compiler(compiled):
    model, opt, compiles = compiled
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad(), vx.capture(model) as plain:
        model(x)
    for _ in range(3):
        with torch.no_grad(), vx.capture(opt) as rec:
            opt(x)
        assert [r.name for r in rec.records] == ["blocks.0.attn", "blocks.1.attn"]
        for a, b in zip(rec.records, plain.records):
            torch.testing.assert_close(a.probs(), b.probs(), atol=1e-6, rtol=0)
    assert compiles["n"] == 0 and rec.layout.grid == (4, 4)
    with pytest.raises(RuntimeError, match="inside"):
        with vx.capture(opt):
            raise RuntimeError("inside")
    # after the scopes the compiler is on again: the first call compiles
    with torch.no_grad():
        opt(x)
    assert compiles["n"] == 1
