"""AttnLRP and CP-LRP for hierarchical transformers: a hand-written oracle on three structurally different
families, batches, the model left as found, conservation, and pointing on the zoo's shapes-hier.

The oracle (:func:`hand_lrp`) works on a float64 deep copy whose attention modules compute attention written
out in Python (``softmax(q k^T * scale + bias) @ v``; the copy only, nothing of vitexplain's), with the rules
applied by hand: the two products' gradients halved at each factor (the uniform rule: 1/4 at q and k, 1/2 at
v, 1/2 on a score bias computed from q, AttnLRP eq. 7 and 13-14) or, for CP-LRP, the attention weights
detached; LayerNorm / LayerNorm2d with the standard deviation detached (eq. 15); GELU ``x * (f(x)/x).detach()``
(the identity rule, eq. 9); everything else (linears, convolutions, PVT's spatial-reduction convolution,
Hiera's mask-unit max pooling of queries and of the residual, windows, reshapes) as autograd has it: the
epsilon rule (epsilon -> 0) for linear maps, winner-take-all for max pooling. Then ``x * dlogit/dx`` summed
over the colour channels. Families: PVTv2 (spatial-reduction attention over a strided convolution), Hiera
(mask units, max-pooled queries), SAM's ViT (windows, padding, decomposed relative-position bias from q,
conv neck with LayerNorm2d).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from timm.layers import LayerNorm2d
from timm.models.vision_transformer_sam import get_decomposed_rel_pos_bias
from torch import nn

import support_table as support
import vitexplain as vx

ROWS = {r.name: r for r in support.rows() if r.group == "hierarchical"}
ORACLE_ROWS = {
    "pvt": "timm PVTv2",
    "hiera": "timm Hiera (SAM 2's encoder family)",
    "sam": "timm SAM ViT (samvit: windowed + global, conv neck)",
}


def _half(y: torch.Tensor) -> torch.Tensor:
    """``y`` whose gradient is halved."""
    return y * 0.5 + (y * 0.5).detach()


def _attend(q, k, v, scale: float, bias, variant: str) -> torch.Tensor:
    """Attention written out, with the rules by hand (see the module docstring)."""
    if variant == "cp":
        q, k, bias = q.detach(), k.detach(), None if bias is None else bias.detach()
    else:
        q, k = _half(q), _half(k)
    scores = (q * scale) @ k.transpose(-2, -1)
    if bias is not None:
        scores = scores + bias
    a = scores.softmax(dim=-1)
    a, v = (a.detach(), v) if variant == "cp" else (_half(a), _half(v))
    return a @ v


def _pvt_forward(m: nn.Module, variant: str):
    def forward(self, x, feat_size):
        b, n, c = x.shape
        q = self.q(x).reshape(b, n, self.num_heads, -1).permute(0, 2, 1, 3)
        if self.sr is not None:  # the spatial-reduction convolution, then LayerNorm, on the keys' tokens
            x = self.sr(x.permute(0, 2, 1).reshape(b, c, *feat_size)).reshape(b, c, -1).permute(0, 2, 1)
            x = self.norm(x)
        k, v = self.kv(x).reshape(b, -1, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(_attend(q, k, v, self.scale, None, variant).transpose(1, 2).reshape(b, n, c))
    return types.MethodType(forward, m)


def _hiera_forward(m: nn.Module, variant: str):
    def forward(self, x):
        b, n, _ = x.shape
        if self.use_mask_unit_attn:
            windows = n // (self.q_stride * self.window_size)
            q, k, v = self.qkv(x).reshape(b, -1, windows, 3, self.heads, self.head_dim).permute(3, 0, 4, 2, 1, 5).unbind(0)
            if self.q_stride > 1:  # max pooling of the queries within each mask unit
                q = q.view(b, self.heads, windows, self.q_stride, -1, self.head_dim).amax(dim=3)
            return self.proj(_attend(q, k, v, self.scale, None, variant).transpose(1, 3).reshape(b, -1, self.dim_out))
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.q_stride > 1:
            q = q.view(b, self.heads, self.q_stride, -1, self.head_dim).amax(dim=2)
        return self.proj(_attend(q, k, v, self.scale, None, variant).transpose(1, 2).reshape(b, -1, self.dim_out))
    return types.MethodType(forward, m)


def _sam_forward(m: nn.Module, variant: str):
    def forward(self, x):
        b, h, w, _ = x.shape
        n = h * w
        qkv = self.qkv(x.reshape(b, n, -1)).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, b * self.num_heads, n, -1).unbind(0)
        bias = get_decomposed_rel_pos_bias(q, self.rel_pos_h, self.rel_pos_w, (h, w), (h, w)) if self.use_rel_pos else None
        out = _attend(q, k, v, self.scale, bias, variant)
        return self.proj(out.view(b, self.num_heads, n, -1).transpose(1, 2).reshape(b, n, -1)).view(b, h, w, -1)
    return types.MethodType(forward, m)


_ATTENTION = {"pvt": ("Attention", _pvt_forward), "hiera": ("MaskUnitAttention", _hiera_forward),
              "sam": ("Attention", _sam_forward)}


def _layer_norm(module, inputs, output):
    x = inputs[0]
    if isinstance(module, LayerNorm2d):  # channels first: normalised over dim 1
        x = x.permute(0, 2, 3, 1)
    mean = x.mean(-1, keepdim=True)
    std = (x.var(-1, unbiased=False, keepdim=True) + module.eps).sqrt()
    out = (x - mean) / std.detach() * module.weight + module.bias
    return out.permute(0, 3, 1, 2) if isinstance(module, LayerNorm2d) else out


def _identity(module, inputs, output):
    x = inputs[0]
    return x * (output / x).detach()


def hand_lrp(model: nn.Module, family: str, x: torch.Tensor, targets: list[int], variant: str) -> torch.Tensor:
    """(B, H, W) relevance of each image's target logit by the hand rules, in float64 on a copy."""
    twin = copy.deepcopy(model).double().eval()
    name, make = _ATTENTION[family]
    replaced = 0
    for module in twin.modules():
        if type(module).__name__ == name:
            module.forward = make(module, variant)
            replaced += 1
        elif isinstance(module, nn.LayerNorm):
            module.register_forward_hook(_layer_norm)
        elif isinstance(module, nn.GELU):
            module.register_forward_hook(_identity)
    assert replaced > 0, f"no {name} in {family}"
    xd = x.double().requires_grad_(True)
    logits = twin(xd)
    score = logits[torch.arange(len(targets)), torch.tensor(targets)].sum()
    (grad,) = torch.autograd.grad(score, xd)
    return (xd * grad).sum(dim=1).detach()


def _model(row_name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = ROWS[row_name].build().eval()
    support.reinit_heads(model, seed)
    with torch.no_grad():  # SAM's relative-position tables start at zero: a bias of zero would test nothing
        for name, p in model.named_parameters():
            if "rel_pos" in name:
                p.normal_(0.0, 0.5)
    return model


#: Measured (float32 fused model vs float64 hand oracle, seeds 0-2, both variants, /tmp script in the branch's
#: report): the largest |difference| / max |oracle| was 4.4e-7 (hiera), 6.7e-7 (pvt), 6.0e-7 (sam); tolerance 1e-5,
#: a 15x margin. Mutants are far above it: the other variant's oracle differs by >= 1.4e-2 (pvt), SAM's score bias
#: at a 1/4 share instead of 1/2 by 1.2e-1.
TOLERANCE = 1e-5


@pytest.mark.parametrize("family", sorted(ORACLE_ROWS))
@pytest.mark.parametrize("method, variant", [("attnlrp", "attnlrp"), ("cp_lrp", "cp")])
@pytest.mark.parametrize("seed", [0, 1])
def test_pixel_relevance_equals_the_hand_written_rules(family, method, variant, seed):
    model = _model(ORACLE_ROWS[family], seed)
    x = torch.randn(2, 3, *ROWS[ORACLE_ROWS[family]].size, generator=torch.Generator().manual_seed(100 + seed))
    targets = [1, 3]
    e = vx.Explainer(model).explain(x, method=method, target=targets)
    expected = hand_lrp(model, family, x, targets, variant)
    assert e.maps.shape == expected.shape
    error = float((e.maps.double() - expected).abs().max() / expected.abs().max())
    assert error < TOLERANCE, f"{family} {method}: relative error {error:.2e}"
