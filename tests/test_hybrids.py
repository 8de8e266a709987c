"""Conv/attention hybrids: recognised by what they call, Grad-CAM on their last stage, attention captured.

Oracles: Grad-CAM computed by hand from the target stage's output and its gradient (plain
autograd; token stages reshaped to their grid here, independently of the adapter), or
captum's LayerGradCam for stages that output (B, C, h, w) maps; window attention recomputed
from the attention module's own weights (torchvision MaxViT) or recorded through the other
code path (Twins: eager softmax vs fused SDPA).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitexplain as vx
import support_table as support
from vitexplain.adapters.cnn import calls_attention

FAMILIES = {f.name: f for f in support.rows() if f.group == "hybrid"}
ROWS = {f.name: f for f in support.rows()}  # Twins and timm MaxViT are hierarchical now (tests/test_hier*.py)


def _build(name):
    torch.manual_seed(0)
    model = ROWS[name].build().eval()
    support.reinit_heads(model)
    return model, torch.randn(2, 3, *ROWS[name].size, generator=torch.Generator().manual_seed(1))


class Mixer(nn.Module):  # attention under a name that does not end in "Attention"
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(x.flatten(2).transpose(1, 2)).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        return out.transpose(1, 2).reshape(b, c, h, w)


class FakeAttention(nn.Module):  # named like attention, calls none: a plain conv gate
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.conv(x))


def _net(block: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), block, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)).eval()


def test_attention_is_detected_by_what_modules_call():
    assert calls_attention(_net(Mixer())) and not calls_attention(_net(FakeAttention()))
    # a conv net whose gate is merely *named* attention is a CNN (class names used to decide)
    assert vx.Explainer(_net(FakeAttention())).family == "cnn"
    # an unknown model that calls attention is not explained as a CNN: a clear error instead
    with pytest.raises(vx.UnsupportedModelError, match="register_adapter"):
        vx.Explainer(_net(Mixer()))


def _token_grid(output: torch.Tensor, size: tuple[int, int], reduction: int) -> torch.Tensor:
    """(B, N, C) stage tokens (prefix first) or (B, C, h, w) -> (B, C, h, w)."""
    if output.dim() == 4:
        return output
    h, w = (math.ceil(s / reduction) for s in size)
    return output[:, output.shape[1] - h * w :].reshape(output.shape[0], h, w, -1).permute(0, 3, 1, 2)


def _reduction(model: nn.Module, layer: str, size: tuple[int, int]) -> int:
    """The stage's stride, measured from one probe forward: the input size over the stage's
    grid (for tokens, the square grid whose size their count allows, after 0 or 1 prefix)."""
    out = {}
    handle = model.get_submodule(layer).register_forward_hook(lambda m, a, o: out.update(o=o[0] if isinstance(o, (tuple, list)) else o))
    with torch.no_grad():
        model(torch.zeros(1, 3, *size))
    handle.remove()
    o = out["o"]
    if o.dim() == 4:
        return size[0] // o.shape[-2]
    n = o.shape[1]
    side = math.isqrt(n)  # square inputs: N = prefix + side^2 with a prefix of 0 or 1
    side = side if side * side in (n, n - 1) else math.isqrt(n - 1)
    return math.ceil(size[0] / side)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hybrid_gradcam_family_matches_hand_oracle(name):
    model, x = _build(name)
    ex = vx.Explainer(model)
    assert ex.family == "cnn" and ex.adapter.hybrid
    assert {"gradcam", "gradcam++", "layercam"} <= set(ex.methods())
    with pytest.raises(vx.UnsupportedMethodError, match="hybrid"):
        ex.explain(x, method="rollout")
    layer = ex.adapter.target_layer
    results = {e.method: e for e in ex.explain(x, method=["gradcam", "layercam"])}
    reduction = _reduction(model, layer, tuple(x.shape[-2:]))
    kept = []
    handle = model.get_submodule(layer).register_forward_hook(
        lambda m, a, o: kept.append(o[0] if isinstance(o, (tuple, list)) else o)
    )
    logits = model(x)
    handle.remove()
    act = kept[0]
    (grad,) = torch.autograd.grad(logits.gather(1, results["gradcam"].targets[:, None]).sum(), act)
    size = tuple(x.shape[-2:])
    a, g = _token_grid(act.detach(), size, reduction), _token_grid(grad, size, reduction)
    gradcam = torch.relu((g.mean((2, 3), keepdim=True) * a).sum(1))
    layercam = torch.relu((g.clamp(min=0) * a).sum(1))
    scale = float(gradcam.abs().max()) + 1e-30
    torch.testing.assert_close(results["gradcam"].maps, gradcam, atol=1e-5 * scale, rtol=1e-4)
    torch.testing.assert_close(results["layercam"].maps, layercam, atol=1e-5 * float(layercam.abs().max() + 1e-30), rtol=1e-4)
    assert float(results["gradcam"].maps.std()) > 0


def test_torchvision_maxvit_window_attention_is_recorded():
    model, x = _build("torchvision MaxViT")
    inputs = []
    modules = [m for m in model.modules() if type(m).__name__ == "RelativePositionalMultiHeadAttention"]
    handles = [m.register_forward_pre_hook(lambda m, a: inputs.append((m, a[0]))) for m in modules]
    with torch.no_grad(), vx.capture(model) as rec:
        model(x)
    for h in handles:
        h.remove()
    assert len(rec.records) == len(modules) == 4  # block and grid attention in each of 2 stages
    for record, (module, inp) in zip(rec.records, inputs):
        b, g, p, _ = inp.shape
        q, k, _ = module.to_qkv(inp).chunk(3, dim=-1)
        q = q.reshape(b, g, p, module.n_heads, module.head_dim).permute(0, 1, 3, 2, 4)
        k = k.reshape(b, g, p, module.n_heads, module.head_dim).permute(0, 1, 3, 2, 4) * module.scale_factor
        probs = torch.softmax(q @ k.transpose(-2, -1) + module.get_relative_positional_bias(), dim=-1)
        assert record.probs().shape == (b * g, module.n_heads, p, p)  # windows folded into the batch
        torch.testing.assert_close(record.probs(), probs.reshape(b * g, module.n_heads, p, p), atol=1e-6, rtol=1e-5)


def test_twins_fused_and_eager_window_attention_agree():
    model, x = _build("timm Twins (SVT)")
    eager = copy.deepcopy(model)
    for module in eager.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = False
    with torch.no_grad(), vx.capture(model) as fused_rec:
        model(x)
    with torch.no_grad(), vx.capture(eager) as eager_rec:
        eager(x)
    assert {r.source for r in fused_rec.records} == {"sdpa"} and {r.source for r in eager_rec.records} == {"eager"}
    assert len(fused_rec.records) == len(eager_rec.records)
    for a, b in zip(fused_rec.records, eager_rec.records):
        assert a.name == b.name and a.q_shape[:3] == b.q_shape[:3]
        torch.testing.assert_close(a.probs(), b.probs(), atol=1e-6, rtol=1e-5)


def test_efficientformer_v2_refuses_attention_methods_with_the_reason():
    """Its heads are mixed after the softmax (talking heads) and a value conv is added: no rule holds."""
    model, x = _build("timm EfficientFormerV2")
    ex = vx.Explainer(model)
    assert ex.family == "cnn"
    with pytest.raises(vx.UnsupportedMethodError, match="talking heads"):
        ex.explain(x, method="rollout")


def test_csatv2_takes_rgb_images_although_its_first_registered_conv_reads_dct_coefficients():
    """CSATv2's first registered Conv2d is a 1 x 1 conv over the 64 DCT coefficients of its stem: the input
    check read 64 channels from it and refused every RGB input, so the Grad-CAM family it lists (and its default)
    were refused ("the model takes 64 channels")."""
    model, x = _build("timm CSATv2 (DCT stem, attention in its last stages)")
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert first.in_channels == 64 and model.in_chans == 3
    ex = vx.Explainer(model)
    e = ex.explain(x)
    assert e.method == "gradcam" and e.maps.shape == (2, 2, 2)
    with pytest.raises(vx.InputError, match=r"takes 3 channels, the input has shape \(2, 64, 128, 128\)"):
        ex.explain(torch.randn(2, 64, 128, 128))


_ATTENTION = ("raw", "rollout", "grad_rollout", "generic", "cdam")
_UNREADABLE = {  # row: what the refusal must name (the reason its attention is no token-to-token map)
    "timm EfficientViT (MIT: ReLU linear attention)": r"ReLU linear attention.*no token-to-token attention matrix",
    "timm EfficientViT (MSRA: cascaded group attention)": r"cascaded group attention.*previous head's output",
    "timm SwiftFormer (additive attention)": r"additive attention.*no token attends to another",
    "timm DaViT (window + channel attention)": r"channel attention.*mixes channels, not tokens",
}


@pytest.mark.parametrize("name", list(_UNREADABLE))
def test_hybrids_whose_attention_is_no_token_map_refuse_the_attention_methods_with_the_reason(name):
    """Linear (EfficientViT MIT) and additive (SwiftFormer) attention form no softmax: these models were taken for
    plain CNNs, and asking for an attention method said only that they are CNNs. Cascaded heads (EfficientViT
    MSRA) and channel attention (DaViT) record softmaxes that are not token-to-token maps. Each is refused with
    its reason; the Grad-CAM family runs (its maps: test_hybrid_gradcam_family_matches_hand_oracle)."""
    model, x = _build(name)
    ex = vx.Explainer(model)
    assert ex.family == "cnn" and ex.adapter.hybrid
    assert not set(_ATTENTION) & set(ex.methods()) and {"gradcam", "gradcam++", "layercam"} <= set(ex.methods())
    for method in _ATTENTION:
        with pytest.raises(vx.UnsupportedMethodError, match=_UNREADABLE[name]):
            ex.explain(x, method=method)
    e = ex.explain(x)
    assert e.method == "gradcam" and e.maps.shape[0] == 2 and bool(torch.isfinite(e.maps).all())
