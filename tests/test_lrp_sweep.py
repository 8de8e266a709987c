"""attnlrp / cp_lrp across the families as a user runs them, and the spellings of torch calls the rules must see.

Conservation is the independent expectation: with every relevance sink of docs/methods.md ("AttnLRP and CP-LRP")
set to zero (biases, class / register / distillation tokens, position embeddings, relative-position tables,
BatchNorm means), CP-LRP's rules are each conservative, so the pixel relevance sums to the explained score; the
reported ``conservation`` must be that sum over the score, computed here from the pixels. Measured on these builds:
|ratio - 1| <= 1e-5 in float32; the floor 1e-4 is ten times that.

The spellings: an activation module of timm that works in place (``Sigmoid(inplace=True)``: ``x.sigmoid_()``)
overwrote the input the identity rule divides by, so its plain gradient passed (measured: 32-99% of the map
moved); in-place calls (``x.sigmoid_()``, ``a.mul_(b)``, ``a *= b``, ``F.elu_``) skipped the rules of their
out-of-place spellings, and in-place or aliased non-linearities (``x.exp_()``, ``x /= n``, ``x **= 2``,
``torch.special.erf``, ``float_power``, ``addcmul``, ``prod``, ``glu``, ``sin``, ``var``) returned maps their
out-of-place spellings are refused for; ReLU6 / hardtanh / hardsigmoid / logsigmoid / softsign / clamp kept their
plain gradient instead of the identity rule of the other element-wise activations.
"""

from __future__ import annotations

import re

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import activations as timm_acts
from torch import nn

import vitexplain as vx
from test_lrp import _relevance
from vitexplain.errors import UnsupportedModelError
from vitexplain.methods.lrp_rules import LRPRules

TOL = 1e-4

#: The relevance sinks of the builds below (docs/methods.md: biases, tokens, position embeddings absorb relevance).
_SINKS = re.compile(r"(bias|pos_embed|position_embed|positional_embedding|cls_token|reg_token|dist_token|"
                    r"class_embedding|register_tokens|running_mean|rel_pos|relative_position)")


def _sink_free(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if _SINKS.search(name) and t.is_floating_point() and "index" not in name:
                t.zero_()
    return model.eval()


def _timm(name: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=5, **kw)


_VIT = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2)
_HF = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def _hf(config: str, model: str, **kw) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, model)(getattr(transformers, config)(image_size=32, patch_size=8, **_HF, **kw))


#: name -> (build, input size, headless): the families the other LRP tests do not check for conservation.
BUILDS = {
    "timm EVA (rope)": (lambda: _timm("eva02_tiny_patch14_224", img_size=28, depth=2), 28, False),
    "timm BEiT (relative bias)": (lambda: _timm("beit_base_patch16_224", **_VIT), 32, False),
    "timm ViT registers + avg": (lambda: _timm("vit_base_patch16_reg4_gap_256", **_VIT), 32, False),
    "timm ViT map pooling": (lambda: _timm("vit_base_patch16_siglip_224", **_VIT), 32, False),
    "timm DeiT distilled": (lambda: _timm("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, depth=2), 32,
                            False),
    "timm NaFlexViT": (lambda: _timm("naflexvit_base_patch16_gap", img_size=32, depth=2, embed_dim=32, num_heads=2),
                       32, False),
    "HF DINOv2 + registers": (lambda: _hf("Dinov2WithRegistersConfig", "Dinov2WithRegistersForImageClassification",
                                          num_labels=5, num_register_tokens=2), 32, False),
    "HF SigLIP tower": (lambda: _hf("SiglipVisionConfig", "SiglipVisionModel"), 32, True),
    "HF CLIP tower": (lambda: _hf("CLIPVisionConfig", "CLIPVisionModel"), 32, True),
    "timm Swin": (lambda: _timm("swin_tiny_patch4_window7_224", img_size=64, window_size=4, embed_dim=16,
                                depths=(1, 1), num_heads=(2, 2)), 64, False),
    "timm CrossViT": (lambda: _timm("crossvit_tiny_240", img_size=48, img_scale=(1.0, 32 / 48), patch_size=(8, 16),
                                    embed_dim=(16, 32), depth=((1, 2, 0), (1, 1, 0)), num_heads=(2, 2),
                                    mlp_ratio=(2, 2, 1)), 48, False),
}


def _state(model: nn.Module) -> tuple:
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [(n, m.training, len(m._forward_hooks), len(m._forward_pre_hooks), getattr(m, "fused_attn", None))
             for n, m in model.named_modules()],
            [(n, p.requires_grad, p.grad) for n, p in model.named_parameters()],
            getattr(getattr(model, "config", None), "_attn_implementation", None))


@pytest.mark.parametrize("name", list(BUILDS))
def test_cp_lrp_conserves_without_sinks_and_reports_the_true_ratio(name):
    """CP-LRP on a sink-free build: the pixels sum to the score; ``conservation`` is that sum / score; a batch of
    two equals its images one by one; the model is left as found (weights, modes, hooks, attention switches)."""
    build, size, headless = BUILDS[name]
    model = _sink_free(build())
    torch.manual_seed(1)
    x = torch.randn(2, 3, size, size)
    ex = vx.Explainer(model)
    target = None
    if headless:
        v = torch.randn(32)
        target = lambda out: out @ v  # noqa: E731 (a linear read of the embedding: its relevance is conserved)
    before = _state(model)
    e = ex.explain(x, method="cp_lrp", target=target)
    total = e.extras["pixels"].flatten(1).sum(1)
    ratio = total / e.extras["score"]
    assert float((ratio - 1).abs().max()) < TOL, ratio
    torch.testing.assert_close(e.extras["conservation"], ratio, rtol=1e-6, atol=1e-7)
    for i in range(2):
        one = ex.explain(x[i:i + 1], method="cp_lrp", target=target if headless else e.targets[i:i + 1])
        torch.testing.assert_close(one.maps[0], e.maps[i], rtol=1e-4, atol=1e-5 * float(e.maps[i].abs().max()))
    after = _state(model)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and before[1:] == after[1:]


def test_conservation_of_a_zero_score_is_nan_not_the_relevance_sum():
    """A zero-initialised head gives a score of exactly 0: the ratio does not exist. It was reported as the relevance
    sum itself (a division by 1), which reads as a ratio."""
    model = _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1).eval()
    nn.init.zeros_(model.head.weight), nn.init.zeros_(model.head.bias)
    e = vx.Explainer(model).explain(torch.randn(2, 3, 32, 32), method="attnlrp", target=[0, 1])
    assert torch.equal(e.extras["score"], torch.zeros(2))
    assert bool(e.extras["conservation"].isnan().all())


# -- the spellings of a call -------------------------------------------------------------------------------------
class _Tokens(nn.Module):
    """Bias-free patch conv -> ``body`` on the tokens (B, N, 8) -> mean -> bias-free head: CP-LRP conserves."""

    def __init__(self, body) -> None:
        super().__init__()
        self.body = body
        self.embed = nn.Conv2d(3, 8, 4, stride=4, bias=False)
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)
        return self.head(self.body(t).mean(1))


def _run(body, method: str = "cp_lrp", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = _Tokens(body).eval()
    torch.manual_seed(100)
    return _relevance(model, torch.randn(2, 3, 8, 8), method, [0, 2], attention=False)


@pytest.mark.parametrize("act", ["Sigmoid", "Tanh", "Swish", "HardSwish", "HardSigmoid"])
def test_an_activation_module_working_in_place_gets_the_identity_rule(act):
    """timm's activation modules with ``inplace=True`` overwrite their input; the rule still divides by the input's
    values and sends the gradient to its node, and the caller's tensor holds the output, as the module leaves it."""
    cls = getattr(timm_acts, act)
    (a, score), (b, _) = _run(cls(inplace=True)), _run(cls(inplace=False))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float((a.flatten(1).sum(1) / score - 1).abs().max()) < TOL
    module, t = cls(inplace=True), torch.randn(4, 8, requires_grad=True) * 1  # (a non-leaf, as activations are)
    expected = cls()(t.detach())
    with LRPRules("cp", model=nn.Sequential(module)):
        out = module(t)
    assert out is t and torch.equal(t.detach(), expected)


#: In-place spelling -> out-of-place spelling of the same function (t: tokens (B, N, 8)).
IN_PLACE = {
    "x.sigmoid_()": (lambda t: (t * 1).sigmoid_(), torch.sigmoid),
    "torch.tanh_(x)": (lambda t: torch.tanh_(t * 1), torch.tanh),
    "F.elu_(x)": (lambda t: F.elu_(t * 1), F.elu),
    "a.mul_(b)": (lambda t: (t * 1).mul_(t.flip(-1)), lambda t: t * t.flip(-1)),
    "a *= b": (lambda t: (t * 1).__imul__(t.flip(-1)), lambda t: t * t.flip(-1)),
    "x.clamp_(max=.)": (lambda t: (t * 1).clamp_(max=0.1), lambda t: t.clamp(max=0.1)),
}


@pytest.mark.parametrize("name", list(IN_PLACE))
def test_in_place_spellings_get_the_rules_of_their_out_of_place_calls(name):
    """Same relevance as the out-of-place call, and on the bias-free model the score is conserved (AttnLRP: the
    uniform rule at the product, the identity rule at the activation)."""
    in_place, out_of_place = IN_PLACE[name]
    for method in ("attnlrp", "cp_lrp"):
        (a, score), (b, _) = _run(in_place, method), _run(out_of_place, method)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert float((a.flatten(1).sum(1) / score - 1).abs().max()) < TOL, method


@pytest.mark.parametrize("act", [F.relu6, F.hardtanh, F.hardsigmoid, F.logsigmoid, F.softsign, torch.special.expit,
                                 lambda t: t.clamp(-0.2, 0.1)])
def test_element_wise_activations_get_the_identity_rule(act):
    """The identity rule passes an element-wise activation's relevance whole: conserved on the bias-free model
    (their plain gradient lost 33-90% of it where they saturate)."""
    a, score = _run(lambda t: act(t * 20))
    assert float((a.flatten(1).sum(1) / score - 1).abs().max()) < TOL


#: Non-linearities no rule covers, spelled the ways their out-of-place call (refused) was not: name -> (body, call).
REFUSED = {
    "x.exp_()": (lambda t: (t * 1).exp_(), "exp_"),
    "x /= n": (lambda t: (t * 1).__itruediv__(t.norm(dim=-1, keepdim=True)), "div"),
    "x.div_(n)": (lambda t: (t * 1).div_(t.norm(dim=-1, keepdim=True)), "div_"),
    "x **= 2": (lambda t: (t * 1).__ipow__(2), "pow"),
    "x.rsqrt_()": (lambda t: (t.abs() + 1).rsqrt_(), "rsqrt_"),
    "special.erf": (lambda t: torch.special.erf(t), "erf"),
    "float_power": (lambda t: torch.float_power(t, 2).float(), "float_power"),
    "addcmul": (lambda t: torch.addcmul(t, t, t.flip(-1)), "addcmul"),
    "addcdiv": (lambda t: torch.addcdiv(t, t, t.abs() + 1), "addcdiv"),
    "prod": (lambda t: torch.stack([t, t.flip(-1)]).prod(0), "prod"),
    "glu": (lambda t: F.glu(torch.cat([t, t.flip(-1)], -1)), "glu"),
    "sin": (lambda t: torch.sin(t), "sin"),
    "var": (lambda t: t * t.var(-1, keepdim=True), "var"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_other_spellings_of_uncovered_non_linearities_are_refused(name):
    body, call = REFUSED[name]
    with pytest.raises(UnsupportedModelError, match=re.escape(call)):
        _run(body)


def test_an_activation_module_overwriting_its_input_without_a_flag_is_refused():
    """A module taken as one element-wise function that changes its input in place, without timm's ``inplace``
    attribute to see it by: its input values are gone, so the rule cannot be computed; refused, not guessed."""

    class Overwrite(nn.Module):
        def forward(self, x):
            return x.sigmoid_()

    Overwrite.__module__ = timm_acts.__name__  # (one of the modules whose activations get the rule as a whole)
    with pytest.raises(UnsupportedModelError, match="overwrites its input"):
        _run(Overwrite())
