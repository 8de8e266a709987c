"""attnlrp / cp_lrp equal lxt 2.1 (the AttnLRP authors' implementation) on the same weights.

lxt patches classes process-wide (``nn.GELU``, ``nn.LayerNorm``, ``nn.MultiheadAttention``,
transformers' attention functions), so it runs in a subprocess on weights and inputs saved here;
nothing of it reaches this process. ``lxt.efficient``'s package ``__init__`` imports its
language-model patches, which fail with transformers 5.x, so the subprocess loads the modules it
needs (``patches``, ``rules``, ``models.vit_torch``) without running that ``__init__``.

- torchvision ViT: lxt's own ``vit_torch.cp_LRP`` patch map (what ``monkey_patch`` applies; lxt
  has CP-LRP only for torchvision) vs ``cp_lrp``;
- Hugging Face ViT: lxt's building blocks (``wrap_attention_forward`` on the SDPA attention
  function, ``layer_norm_forward`` on ``nn.LayerNorm``, ``non_linear_forward`` on the GELU) vs
  ``attnlrp``, and ``cp_wrap_attention_forward`` vs ``cp_lrp``.

Floor: 1e-5 relative (max abs difference over the largest relevance), the issue's.
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

RTOL = 1e-5

_PRELUDE = textwrap.dedent("""
    import os, sys, types, torch
    import lxt
    root = os.path.join(os.path.dirname(lxt.__file__), "efficient")
    for name, path in (("lxt.efficient", root), ("lxt.efficient.models", os.path.join(root, "models"))):
        stub = types.ModuleType(name)
        stub.__path__ = [path]
        sys.modules[name] = stub
    from lxt.efficient import patches
    model, x, target = torch.load(sys.argv[1], weights_only=False)
""")

#: lxt's rules at scaled_dot_product_attention, by argv[3]: AttnLRP (q and k's gradient / 4, v's / 2) or CP-LRP
#: ("cp_lrp": q and k detached)
_LRP_SDPA = textwrap.dedent("""
    import torch.nn.functional as F
    from lxt.efficient.rules import divide_gradient, stop_gradient
    sdpa = F.scaled_dot_product_attention
    cp = sys.argv[3] == "cp_lrp"

    def lrp_sdpa(q, k, v, *args, **kwargs):
        if cp:
            q, k = stop_gradient(q), stop_gradient(k)
        else:
            q, k, v = divide_gradient(q, 4), divide_gradient(k, 4), divide_gradient(v, 2)
        return sdpa(q, k, v, *args, **kwargs)

    F.scaled_dot_product_attention = lrp_sdpa
""")

_TORCHVISION = _PRELUDE + textwrap.dedent("""
    from lxt.efficient.models import vit_torch
    for cls, patch in vit_torch.cp_LRP.items():
        assert patch(cls)
    x = x.clone().requires_grad_(True)
    y = model(x)
    y[torch.arange(len(x)), target].sum().backward()
    torch.save((x * x.grad).detach().sum(1), sys.argv[2])
""")

_HF = _PRELUDE + textwrap.dedent("""
    from transformers import activations
    from transformers.models.vit import modeling_vit
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    wrap = patches.wrap_attention_forward if sys.argv[3] == "attnlrp" else patches.cp_wrap_attention_forward
    ALL_ATTENTION_FUNCTIONS["sdpa"] = wrap(ALL_ATTENTION_FUNCTIONS["sdpa"])
    assert patches.patch_method(patches.layer_norm_forward, torch.nn.LayerNorm)
    assert patches.patch_method(patches.non_linear_forward, activations.GELUActivation, keep_original=True)
    x = x.clone().requires_grad_(True)
    y = model(pixel_values=x).logits
    y[torch.arange(len(x)), target].sum().backward()
    torch.save((x * x.grad).detach().sum(1), sys.argv[2])
""")


# (the SDPA rules reach the encoder's and the pooling head's attention)
_AIMV2 = _PRELUDE + _LRP_SDPA + textwrap.dedent("""
    from transformers.models.aimv2 import modeling_aimv2 as aimv2
    assert patches.patch_method(patches.rms_norm_forward, aimv2.Aimv2RMSNorm)
    assert patches.patch_method(patches.gated_mlp_forward, aimv2.Aimv2MLP)
    x = x.clone().requires_grad_(True)
    (model(pixel_values=x).pooler_output * target).sum().backward()  # target: a readout vector (D,)
    torch.save((x * x.grad).detach().sum(1), sys.argv[2])
""")


_GPT2_CAPTIONER = _PRELUDE + textwrap.dedent("""
    import torch.nn.functional as F
    from lxt.efficient.rules import divide_gradient
    from transformers import activations
    sdpa = F.scaled_dot_product_attention

    def lrp_sdpa(q, k, v, *args, **kwargs):  # encoder self-, decoder self- and cross-attention
        return sdpa(divide_gradient(q, 4), divide_gradient(k, 4), divide_gradient(v, 2), *args, **kwargs)

    F.scaled_dot_product_attention = lrp_sdpa
    assert patches.patch_method(patches.layer_norm_forward, torch.nn.LayerNorm)
    for cls in (activations.GELUActivation, activations.NewGELUActivation):  # ViT's GELU, GPT-2's tanh GELU
        assert patches.patch_method(patches.non_linear_forward, cls, keep_original=True)
    x = x.clone().requires_grad_(True)
    start = torch.full_like(target[:, :1], model.config.decoder_start_token_id)
    logits = model(pixel_values=x, decoder_input_ids=torch.cat([start, target[:, :-1]], 1)).logits
    scores = logits.gather(2, target[..., None])[..., 0]  # (B, T): word t's logit at position t
    maps = []
    for t in range(scores.shape[1]):
        (grad,) = torch.autograd.grad(scores[:, t].sum(), x, retain_graph=True)
        maps.append((x * grad).detach().sum(1))
    torch.save(torch.stack(maps, 1), sys.argv[2])
""")


def _lxt(tmp_path, code: str, model, x, target, *extra: str) -> torch.Tensor:
    """lxt's relevance (B, H, W) of ``model`` on ``x`` for ``target`` (B,), computed in a subprocess."""
    inputs, out = tmp_path / "inputs.pt", tmp_path / "relevance.pt"
    torch.save((model, x, target), inputs)
    done = subprocess.run([sys.executable, "-c", code, str(inputs), str(out), *extra], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _torchvision_vit() -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64, num_classes=5)
    torch.nn.init.normal_(model.heads.head.weight, std=0.2)  # torchvision initialises the head to zero
    return model.eval()


def _hf_vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, num_labels=5, attn_implementation="sdpa")
    return ViTForImageClassification(config).eval()


def test_cp_lrp_equals_lxt_on_torchvision_vit(tmp_path):
    model = _torchvision_vit()
    x = torch.randn(3, 3, 32, 32)
    target = torch.tensor([0, 3, 4])
    theirs = _lxt(tmp_path, _TORCHVISION, model, x, target)
    ours = vx.Explainer(model).explain(x, method="cp_lrp", target=target).maps
    assert ours.shape == theirs.shape == (3, 32, 32)
    assert _close(ours, theirs) < RTOL


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_equals_lxt_building_blocks_on_hf_vit(tmp_path, method):
    model = _hf_vit()
    x = torch.randn(2, 3, 32, 32)
    target = torch.tensor([1, 2])
    theirs = _lxt(tmp_path, _HF, model, x, target, method)
    ours = vx.Explainer(model).explain(x, method=method, target=target).maps
    assert ours.shape == theirs.shape == (2, 32, 32)
    assert _close(ours, theirs) < RTOL


@pytest.mark.parametrize("gamma", [0.1, 0.25, 2.0])
def test_gamma_rules_equal_zennit(gamma):
    """The Gamma option equals zennit's ``rules.Gamma`` on linears and convolutions (ReLU passes the gradient
    in both), on a small CNN + MLP with biases and signed inputs."""
    require("zennit", "pip install --no-deps zennit (test-only peer; .ci/run installs it)")
    from zennit.composites import LayerMapComposite
    from zennit.rules import Gamma

    from test_lrp import _relevance

    torch.manual_seed(5)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(6, 4, 3, stride=2),
        torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 7 * 7, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3),
    ).eval()
    x = torch.randn(2, 3, 16, 16)
    target = torch.tensor([2, 0])
    ours, _ = _relevance(model, x, "cp_lrp", target, attention=False, linear_gamma=gamma,
                          conv_gamma=gamma)
    composite = LayerMapComposite([(torch.nn.Conv2d, Gamma(gamma)), (torch.nn.Linear, Gamma(gamma))])
    xg = x.clone().requires_grad_(True)
    with composite.context(model) as modified:
        out = modified(xg)
        (grad,) = torch.autograd.grad(out, xg, torch.nn.functional.one_hot(target, 3).float() * out)
    theirs = grad  # zennit's rules propagate the relevance itself as the "gradient"
    assert _close(ours, theirs) < RTOL


def test_equals_lxt_module_patches_on_hf_aimv2(tmp_path):
    """AIMv2 writes its RMSNorm out in Python and gates its MLP with a SiLU module: lxt patches those classes
    (``rms_norm_forward``, ``gated_mlp_forward``), vitexplain applies its rules to the module (the RMSNorm as a
    whole) and to the calls inside (the product, the SiLU) on the unchanged model."""
    from transformers import Aimv2VisionConfig, Aimv2VisionModel

    torch.manual_seed(0)
    config = Aimv2VisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                               image_size=32, patch_size=8)
    model = Aimv2VisionModel(config).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: spread them so the norms' rule is visible
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.normal_(1.0, 0.3)
    x, readout = torch.randn(2, 3, 32, 32), torch.randn(32)
    theirs = _lxt(tmp_path, _AIMV2, model, x, readout, "attnlrp")
    ours = vx.Explainer(model).explain(x, method="attnlrp", target=lambda out: (vx.targets.embedding_of(out) * readout).sum(-1)).maps
    assert ours.shape == theirs.shape == (2, 32, 32)
    assert _close(ours, theirs) < RTOL


def test_equals_lxt_module_patches_on_a_gpt2_captioner(tmp_path):
    """Per-word AttnLRP on a VisionEncoderDecoder with a GPT-2 decoder, whose GELU (``NewGELUActivation``) is
    written out in Python: lxt patches the activation class with its identity rule; vitexplain applies the rule to
    the module as a whole on the unchanged model."""
    from support_table import _vision_encoder_decoder

    torch.manual_seed(0)
    model = _vision_encoder_decoder().eval()
    x, ids = torch.randn(2, 3, 32, 32), torch.tensor([[5, 6, 7], [8, 9, 10]])
    theirs = _lxt(tmp_path, _GPT2_CAPTIONER, model, x, ids)
    ours = vx.Explainer(model).explain_caption(x, method="attnlrp", caption=ids.tolist()).maps
    assert ours.shape == theirs.shape == (2, 3, 32, 32)
    assert _close(ours, theirs) < RTOL
