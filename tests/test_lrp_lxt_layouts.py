"""attnlrp / cp_lrp equal lxt 2.1's rules on timm ViTs with the token layouts tests/test_lrp_lxt.py
does not use: registers, average pooling (with registers, with a class token), a distilled DeiT,
EVA with rotary embeddings; on a non-square 3 x 5 grid (the models of tests/test_layouts_oracle.py).

lxt has no timm model patch, so its building blocks are applied the way its own patches apply them
to Hugging Face models (tests/test_lrp_lxt.py): its ``divide_gradient`` (AttnLRP: q, k by 4, v by 2)
or ``stop_gradient`` (CP-LRP: q, k) on the inputs of ``F.scaled_dot_product_attention``, which timm's
attention calls; its ``layer_norm_forward`` on every LayerNorm class in the model and its
``non_linear_forward`` on every GELU class. lxt patches process-wide, so it runs in one subprocess
per method on weights and inputs saved here. Floor: 1e-5 relative (max abs difference over lxt's
largest relevance), the issue's; measured at most 4.9e-7 (cp_lrp on the distilled DeiT).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import vitexplain as vx
from peers import require

require("lxt", "pip install --no-deps lxt==2.1 zennit (test-only peer; .ci/run installs it)")

from test_layouts_oracle import MODELS, SIZE, sharpened  # noqa: E402
from test_lrp_lxt import _LRP_SDPA, _PRELUDE  # noqa: E402

RTOL = 1e-5

_TIMM = _PRELUDE.replace("model, x, target = torch.load(sys.argv[1], weights_only=False)",
                         "cases = torch.load(sys.argv[1], weights_only=False)") + _LRP_SDPA + textwrap.dedent("""
    modules = [m for model, _, _ in cases for m in model.modules()]
    for cls in {type(m) for m in modules if isinstance(m, torch.nn.LayerNorm)}:
        patches.patch_method(patches.layer_norm_forward, cls)
    for cls in {type(m) for m in modules if isinstance(m, torch.nn.GELU)}:
        patches.patch_method(patches.non_linear_forward, cls, keep_original=True)
    out = []
    for model, x, target in cases:
        x = x.clone().requires_grad_(True)
        model(x)[torch.arange(len(x)), target].sum().backward()
        out.append((x * x.grad).detach().sum(1))
    torch.save(out, sys.argv[2])
""")


@pytest.fixture(scope="module")
def cases():
    return {name: (*sharpened(name), torch.tensor([1, 3])) for name in MODELS}


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_equals_lxt_rules_on_every_layout(tmp_path, cases, method):
    inputs, relevance = tmp_path / "inputs.pt", tmp_path / "relevance.pt"
    torch.save(list(cases.values()), inputs)
    done = subprocess.run([sys.executable, "-c", _TIMM, str(inputs), str(relevance), method], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for (name, (model, x, target)), theirs in zip(cases.items(), torch.load(relevance)):
        ours = vx.Explainer(model).explain(x, method=method, target=target).maps
        assert ours.shape == theirs.shape == (2, *SIZE), name
        assert float((ours - theirs).abs().max() / theirs.abs().max()) < RTOL, name
