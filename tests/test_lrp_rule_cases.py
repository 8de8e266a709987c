"""The LRP rules on the operations models write in ways the first rules did not see, each against an independent
expectation (exact conservation of a bias-free model, the same function written another way, invariance to
frozen weights) or a refusal that says why:

- the uniform rule (AttnLRP eq. 7) is for products of two activations: a factor computed from the weights alone
  (a learned temperature ``t.exp()``, Swin V2's ``logit_scale``) is a constant of the layer, frozen or not;
  ``torch.einsum`` of activations is a product like ``@``; an input-dependent ``attn_mask`` at SDPA is part of the
  scores; a product fused with an addition (``baddbmm``) is refused;
- normalisations hold their scale constant: ``F.normalize`` (Swin V2), ``F.group_norm`` (hybrid stems), an
  ``...RMSNorm`` module written in Python (AIMv2); a norm written inline is refused;
- activation modules written in Python (GPT-2's ``NewGELUActivation``) get the identity rule as a whole;
  the identity rule's ratio is float32's in float16 models;
- the Gamma option reaches linears written as ``addmm`` (GPT-2's ``Conv1D``) or ``x @ W``;
- log-probability targets and gradient checkpointing are refused with what to do.
"""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

import vitexplain as vx
from test_lrp import _relevance


def _assert_same_relevance(model: nn.Module, reference: nn.Module, x: torch.Tensor, targets: list[int]) -> None:
    """``model`` and ``reference`` (the same computation written another way) given the same weights get the same
    AttnLRP and CP-LRP relevance, to 1e-5 of its scale."""
    reference.load_state_dict(model.state_dict())
    for method in ("attnlrp", "cp_lrp"):
        a, _ = _relevance(model, x, method, targets)
        b, _ = _relevance(reference, x, method, targets)
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), method


class _Tempered(nn.Module):
    """A bias-free linear model whose logits are scaled by a learned temperature ``exp(t)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4, bias=False)
        self.head = nn.Linear(8, 3, bias=False)
        self.log_t = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x).flatten(2).mean(2)) * self.log_t.exp()


def test_a_learned_temperature_is_a_constant_of_the_layer():
    torch.manual_seed(0)
    model = _Tempered().eval()
    x = torch.randn(2, 3, 8, 8)
    for method in ("attnlrp", "cp_lrp"):
        relevance, score = _relevance(model, x, method, [0, 2], attention=False)
        # independent expectation: a bias-free linear model's LRP is gradient x input, summing to the logit
        logits = model(x).detach()[[0, 1], [0, 2]]
        assert torch.allclose(score, logits)
        assert torch.allclose(relevance.flatten(1).sum(1), logits, rtol=1e-5, atol=1e-7), method


def _swinv2() -> nn.Module:
    torch.manual_seed(1)
    model = timm.create_model("swinv2_cr_tiny_ns_224", pretrained=False, img_size=64, window_size=4, embed_dim=16,
                              depths=(1, 1), num_heads=(2, 2), num_classes=3).eval()
    with torch.no_grad():  # timm zero-initialises the residual post-norms: the attention would be dead
        for module in model.modules():
            if isinstance(module, nn.LayerNorm) and float(module.weight.abs().max()) == 0:
                module.weight.normal_(1.0, 0.2)
    return model


def test_frozen_weights_give_the_same_maps():
    """Swin V2 multiplies its attention scores by ``logit_scale.exp()`` (a parameter)."""
    model = _swinv2()
    x = torch.randn(2, 3, 64, 64)
    live = vx.Explainer(model).explain(x, method="attnlrp", target=[0, 2]).maps
    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    frozen = vx.Explainer(model).explain(x, method="attnlrp", target=[0, 2]).maps
    assert float((live - frozen).abs().max()) <= 1e-5 * float(frozen.abs().max())
    model.requires_grad_(True)
    assert [p.requires_grad for p in model.parameters()] == flags


class _Normalized(nn.Module):
    """Bias-free: tokens L2-normalised (``F.normalize``, as Swin V2's cosine attention does to q and k), then a
    linear head. Without the rule its output is homogeneous of degree 0 in x, so plain gradient x input sums to 0."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4, bias=False)
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = nn.functional.normalize(self.embed(x).flatten(2), dim=1)  # (B, 8, n) unit vectors per token
        return self.head(tokens.mean(2))


def test_l2_normalisation_gets_the_norm_rule():
    """``F.normalize`` is RMSNorm divided by sqrt(d): the identity rule on the normalisation (the norm held
    constant, AttnLRP Prop. 3.4, as for LayerNorm and ``F.cosine_similarity``) makes the model linear."""
    torch.manual_seed(2)
    model = _Normalized().eval()
    x = torch.randn(2, 3, 8, 8)
    for method in ("attnlrp", "cp_lrp"):
        relevance, score = _relevance(model, x, method, [1, 0], attention=False)
        logits = model(x).detach()[[0, 1], [1, 0]]
        assert torch.allclose(score, logits)
        assert torch.allclose(relevance.flatten(1).sum(1), logits, rtol=1e-5, atol=1e-7), method


def test_half_precision_with_exact_zero_pre_activations():
    """The identity rule's ``f(x) / (x + 1e-10)``: in float16 1e-10 rounds away, so an exact zero (a pruned
    unit, or an underflow: |x| < 3e-8 rounds to 0 in float16, a few per million entries) gave 0 / 0 = NaN and
    the whole map broke down. The ratio is float32's, as for a float32 model (where it is 0 there)."""
    torch.manual_seed(3)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_classes=4).eval()
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight[:5] = 0  # pruned units: their GELU input is exactly 0
        model.blocks[0].mlp.fc1.bias[:5] = 0
    x = torch.randn(2, 3, 32, 32)
    full = vx.Explainer(model).explain(x, method="attnlrp", target=[0, 1]).maps
    half = vx.Explainer(model.half()).explain(x.half(), method="attnlrp", target=[0, 1]).maps
    # float16 rounding: measured 1.3e-3 of the largest relevance on this model, floor 10x that
    assert float((half.float() - full).abs().max()) <= 0.013 * float(full.abs().max())


class _BiasedAttention(nn.Module):
    """One attention layer whose additive score bias is computed from the queries (SAM-style decomposed
    relative positions: ``bias = q @ R``), by SDPA's ``attn_mask`` or written out in Python."""

    def __init__(self, fused: bool, dim: int = 8, tokens: int = 4) -> None:
        super().__init__()
        self.fused = fused
        self.embed = nn.Conv2d(3, dim, 4, stride=4, bias=False)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.rel = nn.Parameter(torch.randn(dim, tokens))
        self.head = nn.Linear(dim, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)  # (B, 4, dim)
        q, k, v = self.qkv(t)[:, None].chunk(3, dim=-1)  # (B, 1, 4, dim) each
        bias = q @ self.rel  # (B, 1, 4, 4): depends on the input
        if self.fused:
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            out = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + bias).softmax(-1) @ v
        return self.head(out[:, 0].mean(1))


def test_an_input_dependent_attention_bias_gets_the_attention_rule_in_sdpa():
    """At SDPA the rule scales q, k, v; a bias computed from the input sits inside the softmax like q k^T:
    it takes the score's share (AttnLRP: x 1/2 from ``A @ v``; CP-LRP: detached with the weights), as the
    same attention written out in Python gets from the rules on its two products."""
    torch.manual_seed(5)
    fused = _BiasedAttention(True).eval()
    _assert_same_relevance(fused, _BiasedAttention(False).eval(), torch.randn(2, 3, 8, 8), [0, 2])


class _EinsumAttention(nn.Module):
    """One attention layer written with ``torch.einsum`` (or with ``@``), eager softmax."""

    def __init__(self, einsum: bool, dim: int = 8) -> None:
        super().__init__()
        self.einsum = einsum
        self.embed = nn.Conv2d(3, dim, 4, stride=4, bias=False)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.head = nn.Linear(dim, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)  # (B, n, dim)
        q, k, v = self.qkv(t).chunk(3, dim=-1)
        if self.einsum:
            attn = torch.einsum("bqd,bkd->bqk", q, k).mul(q.shape[-1] ** -0.5).softmax(-1)
            out = torch.einsum("bqk,bkd->bqd", attn, v)
        else:
            out = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1) @ v
        return self.head(out.mean(1))


def test_attention_written_with_einsum_gets_the_uniform_rule():
    """``torch.einsum`` of two activations is a product like ``@``: without the rule there, q, k and v kept
    their whole gradient (the softmax still counted as attention), so the maps were silently not AttnLRP's."""
    torch.manual_seed(6)
    mine = _EinsumAttention(True).eval()
    _assert_same_relevance(mine, _EinsumAttention(False).eval(), torch.randn(2, 3, 8, 8), [2, 1])


class _GroupNormed(nn.Module):
    """Bias-free conv stem with a GroupNorm (as timm's hybrid ViTs' ResNet stems), then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.norm = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(x)).mean((2, 3)))


def test_group_norm_gets_the_norms_rule():
    """GroupNorm is LayerNorm over groups of channels: its standard deviation is held constant (the identity
    rule on the normalisation). Without it the output is scale-free in x and gradient x input sums to 0; with it
    the bias-free model is linear and conserves its logit exactly."""
    torch.manual_seed(7)
    model = _GroupNormed().eval()
    with torch.no_grad():
        model.norm.weight.normal_(1.0, 0.3)
        model.norm.bias.zero_()
    x = torch.randn(2, 3, 6, 6)
    for method in ("attnlrp", "cp_lrp"):
        relevance, score = _relevance(model, x, method, [0, 1], attention=False)
        logits = model(x).detach()[[0, 1], [0, 1]]
        assert torch.allclose(score, logits, rtol=1e-5, atol=1e-6)
        assert torch.allclose(relevance.flatten(1).sum(1), logits, rtol=1e-4, atol=1e-6), method


class _GPT2Mlp(nn.Module):
    """Bias-free: a linear, GPT-2's activation module (the tanh GELU written out in Python:
    ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))``), a linear, a head."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.activations import NewGELUActivation

        self.embed = nn.Conv2d(3, 8, 4, stride=4, bias=False)
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16, bias=False), NewGELUActivation(), nn.Linear(16, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.embed(x).flatten(2).transpose(1, 2)))).mean(1)


def test_an_activation_module_written_in_python_gets_the_identity_rule():
    """Split into single torch calls, GPT-2's GELU gets the product rule at ``x * (1 + tanh(.))`` (the constant 1
    then keeps a quarter of x's relevance) and the plain gradient at the power: not AttnLRP's identity rule, and
    not conservative. As one element-wise function it is: the bias-free model conserves its logit exactly; the
    relevance equals that of ``F.gelu(approximate="tanh")``, the same function, under the function rule; and the
    hooks are gone afterwards."""
    torch.manual_seed(8)
    model = _GPT2Mlp().eval()
    x = torch.randn(2, 3, 8, 8)
    twin = _GPT2Mlp().eval()
    twin.load_state_dict(model.state_dict())
    twin.act = _TanhGelu()
    for method in ("attnlrp", "cp_lrp"):
        relevance, score = _relevance(model, x, method, [0, 2], attention=False)
        logits = model(x).detach()[[0, 1], [0, 2]]
        assert torch.allclose(relevance.flatten(1).sum(1), logits, rtol=1e-4, atol=1e-6), method
        oracle, _ = _relevance(twin, x, method, [0, 2], attention=False)
        assert float((relevance - oracle).abs().max()) <= 1e-5 * float(oracle.abs().max()), method
    assert not model.act._forward_hooks and not model.act._forward_pre_hooks
    from vitexplain.methods.lrp_rules import LRPRules

    with pytest.raises(RuntimeError, match="inside"), LRPRules("attnlrp", model=model):
        assert model.act._forward_hooks  # scoped to the with block
        raise RuntimeError("inside")
    assert not model.act._forward_hooks and not model.act._forward_pre_hooks


class _TanhGelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x, approximate="tanh")


class _Projections(nn.Module):
    """Conv stem, then two projections: as ``nn.Linear`` or written as GPT-2's ``Conv1D`` (``torch.addmm(b, x, W)``)
    and OpenCLIP's output projection (``x @ W``), with the same weights."""

    def __init__(self, written: bool) -> None:
        super().__init__()
        self.written = written
        self.embed = nn.Conv2d(3, 8, 4, stride=4)
        self.fc, self.proj = nn.Linear(8, 16), nn.Linear(16, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2).reshape(-1, 8)  # (B * n, 8)
        if self.written:
            h = torch.addmm(self.fc.bias, t, self.fc.weight.t())
            out = torch.relu(h).view(len(x), -1, 16).mean(1) @ self.proj.weight.t()
        else:
            out = self.proj(torch.relu(self.fc(t)).view(len(x), -1, 16).mean(1))
        return out


def test_the_gamma_rule_reaches_linears_written_as_addmm_or_matmul():
    """``linear_gamma`` applies to every linear layer; GPT-2's Conv1D (addmm) and a projection written ``x @ W``
    are linear layers: without the rule there they kept the epsilon rule, silently."""
    torch.manual_seed(9)
    linear = _Projections(False).eval()
    written = _Projections(True).eval()
    written.load_state_dict(linear.state_dict())
    x = torch.randn(2, 3, 8, 8)
    for gamma in (0.0, 0.3):
        a, _ = _relevance(written, x, "attnlrp", [0, 2], attention=False, linear_gamma=gamma)
        b, _ = _relevance(linear, x, "attnlrp", [0, 2], attention=False, linear_gamma=gamma)
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), gamma


@pytest.mark.parametrize("score", [lambda out: out.log_softmax(-1)[:, 0],
                                   lambda out: torch.nn.functional.log_softmax(out, dim=1)[:, 0],
                                   lambda out: out[:, 0] - out.logsumexp(-1)])
def test_a_log_probability_target_raises_instead_of_returning_wrong_maps(score):
    """LRP explains a logit; a log-softmax (or logsumexp) on the path is no rule's operation, as a softmax is not:
    the relevance of ``log p`` through its plain gradient is not LRP's, so it is refused, not returned."""
    from vitexplain.errors import UnsupportedModelError

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                              num_classes=4).eval()
    with pytest.raises(UnsupportedModelError, match="log"):
        vx.Explainer(model).explain(torch.randn(1, 3, 32, 32), method="attnlrp", target=score)


class _PythonRMSNorm(nn.Module):
    """An RMSNorm written out in Python (as many Hugging Face models do): ``x * rsqrt(mean(x^2) + eps) * w``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4, bias=False)
        self.weight = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.head(t.mean(1))


def test_a_norm_written_out_in_python_raises_instead_of_returning_wrong_maps():
    """The rules see its power, mean, rsqrt and product one by one: the standard deviation is not held
    constant and the product of x and rsqrt(.) is halved as if both were activations, so the maps would not
    be LRP's. Element-wise non-linear calls on an activation are refused, saying which."""
    from vitexplain.errors import UnsupportedModelError

    torch.manual_seed(10)
    with pytest.raises(UnsupportedModelError, match="rsqrt"):
        _relevance(_PythonRMSNorm().eval(), torch.randn(1, 3, 8, 8), "attnlrp", 0, attention=False)


class HFStyleRMSNorm(nn.Module):
    """Hugging Face's RMSNorm (Llama's, AIMv2's): written out in Python, in its own module."""

    def __init__(self, dim: int, functional: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim) * 0.3 + 1)
        self.variance_epsilon, self.functional = 1e-6, functional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.functional:  # the same function through torch's F.rms_norm, which the rules see as one call
            return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class _RMSNormed(nn.Module):
    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4, bias=False)
        self.norm = HFStyleRMSNorm(8, functional)
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x).flatten(2).transpose(1, 2)).mean(1))


def test_an_rmsnorm_module_written_in_python_gets_the_norms_rule():
    """An ``...RMSNorm`` module (Hugging Face's, e.g. AIMv2's) is one RMSNorm: with the root mean square held
    constant its output is x times a per-element constant. Its relevance equals F.rms_norm's under the function
    rule, and the bias-free model conserves its logit exactly (before: refused, or silently the product rule)."""
    torch.manual_seed(11)
    written = _RMSNormed(False).eval()
    functional = _RMSNormed(True).eval()
    functional.load_state_dict(written.state_dict())
    x = torch.randn(2, 3, 8, 8)
    for method in ("attnlrp", "cp_lrp"):
        a, score = _relevance(written, x, method, [1, 2], attention=False)
        b, _ = _relevance(functional, x, method, [1, 2], attention=False)
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), method
        assert torch.allclose(a.flatten(1).sum(1), score, rtol=1e-4, atol=1e-6), method


def test_gradient_checkpointing_is_refused_with_what_to_do():
    """A checkpointed block recomputes its forward in the backward, outside the rules (torch function modes do not
    reach it): torch then raised its own CheckpointError about tensor metadata. The method says what it is and how
    to turn it off, and the model is left with checkpointing on, as found."""
    from vitexplain.errors import UnsupportedModelError

    torch.manual_seed(12)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_classes=4).eval()
    model.set_grad_checkpointing(True)
    with pytest.raises(UnsupportedModelError, match="set_grad_checkpointing"):
        vx.Explainer(model).explain(torch.randn(2, 3, 32, 32), method="attnlrp", target=[0, 1])
    assert model.grad_checkpointing


class GatedRMSNorm(nn.Module):
    """Mamba-style: ``rmsnorm(x * silu(gate))`` written out in Python, two inputs: not one element-wise function."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x * nn.functional.silu(gate)
        return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4, bias=False)
        self.gate = nn.Linear(8, 8, bias=False)
        self.norm = GatedRMSNorm(8)
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(t, self.gate(t)).mean(1))


def test_a_norm_module_with_a_second_input_is_not_taken_as_one_element_wise_function():
    """The module rule is out / x for a call of one tensor; a call with a gate would have lost the gate's relevance
    silently: its arithmetic runs under the rules instead, which refuse the written-out norm."""
    from vitexplain.errors import UnsupportedModelError

    torch.manual_seed(13)
    with pytest.raises(UnsupportedModelError, match="rsqrt"):
        _relevance(_Gated().eval(), torch.randn(1, 3, 8, 8), "attnlrp", 0, attention=False)


def test_a_fused_multiply_add_of_two_activations_is_refused():
    """``torch.baddbmm(bias, q, k^T)`` (attention scores in some Hugging Face models) is a product of two
    activations inside one call, where the uniform rule cannot reach the product alone: refused, not ignored."""
    from vitexplain.errors import UnsupportedModelError
    from vitexplain.methods.lrp_coverage import check_coverage
    from vitexplain.methods.lrp_rules import LRPRules

    torch.manual_seed(14)
    x = torch.randn(2, 4, 8, requires_grad=True)
    q, k = x * 2.0, x.flip(1)
    for fused in (lambda: torch.baddbmm(torch.zeros(2, 4, 4), q, k.transpose(1, 2)),
                  lambda: torch.addmm(torch.zeros(4, 4), q[0], k[0].t()),
                  lambda: torch.addbmm(torch.zeros(4, 4), q, k.transpose(1, 2))):
        rules = LRPRules("attnlrp")
        with rules:
            fused()
        with pytest.raises(UnsupportedModelError, match="multiply-add"):
            check_coverage(rules, "attnlrp", "M", attention=False)


class _InplaceAttention(nn.Module):
    """Eager attention whose scores are scaled and biased in place (``attn *= s; attn += b``), or out of place."""

    def __init__(self, inplace: bool, dim: int = 8) -> None:
        super().__init__()
        self.inplace = inplace
        self.embed = nn.Conv2d(3, dim, 4, stride=4, bias=False)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.bias = nn.Parameter(torch.randn(4, 4))
        self.head = nn.Linear(dim, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.embed(x).flatten(2).transpose(1, 2)).chunk(3, dim=-1)
        attn = q @ k.transpose(-2, -1)
        if self.inplace:
            attn *= q.shape[-1] ** -0.5
            attn += self.bias
        else:
            attn = attn * q.shape[-1] ** -0.5 + self.bias
        return self.head((attn.softmax(-1) @ v).mean(1))


def test_attention_scores_modified_in_place_get_the_same_rules():
    """The product rule's output was a view of its input, so ``attn += bias`` on it raised torch's "view created
    inside a custom Function is being modified inplace": now an alias, with the same relevance as out of place."""
    torch.manual_seed(15)
    inplace = _InplaceAttention(True).eval()
    _assert_same_relevance(inplace, _InplaceAttention(False).eval(), torch.randn(2, 3, 8, 8), [0, 1])
