"""timm CaiT, XCiT and ConViT: what applies is computed right; what does not is refused.

- CaiT: the class-attention blocks carry the readout; its patch blocks use talking-heads
  attention (heads mixed after the softmax). XCiT: the XCA blocks attend across channels;
  token attention lives in the class-attention blocks. ConViT: its first blocks use gated
  positional self-attention (two softmaxes, neither the attention applied to the values).
  Attention methods read the blocks with plain token attention; rollout-type methods are
  refused with a clear error saying why.
- Oracles are independent of vitexplain: raw attention recomputed by hand from the attention
  module's own weights on its input; CDAM from plain autograd; integrated CDAM from the whole
  model run with the last block's first-norm output replaced (so the adapter's ``tail`` is
  checked against the model itself, the bug the issue found in CaiT).
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
from vitexplain.adapters.vit import TimmViTAdapter

import timm  # noqa: E402,F401  (a dependency of the package: never skipped)
from timm.models.cait import Cait  # noqa: E402
from timm.models.convit import ConVit  # noqa: E402
from timm.models.xcit import Xcit  # noqa: E402

GRID = (4, 4)


def _sharpen(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q.weight", "k.weight", "qkv.weight", "qk.weight")):
                p.mul_(3.0)
            if name == "head.weight":
                p.normal_(0, 1.0)
    return model.eval()


BUILDS = {
    "cait": lambda: Cait(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, depth_token_only=2, num_classes=5),
    "xcit": lambda: Xcit(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, cls_attn_layers=2, num_classes=5),
    "convit": lambda: ConVit(img_size=32, patch_size=8, embed_dim=16, depth=3, num_heads=2, local_up_to_layer=2, num_classes=5),
}
WHY = {"cait": "talking-heads", "xcit": "across channels", "convit": "gated positional"}
ATTENTION_BLOCKS = {"cait": "blocks_token_only.1", "xcit": "cls_attn_blocks.1", "convit": "blocks.2"}


@pytest.fixture(scope="module", params=list(BUILDS))
def case(request):
    torch.manual_seed(0)
    return request.param, _sharpen(BUILDS[request.param]())


def _hand_attention(block, tokens):
    """Mean-over-heads class-token row of a block's attention, from its weights: (B, N)."""
    attn = block.attn
    b, n, c = tokens.shape
    h = attn.num_heads
    if hasattr(attn, "qkv"):  # ConViT MHSA
        q, k, _ = attn.qkv(tokens).reshape(b, n, 3, h, c // h).permute(2, 0, 3, 1, 4)
        q = q[:, :, :1]
    else:  # CaiT / XCiT ClassAttn: the class token queries every token
        q = attn.q(tokens[:, 0]).reshape(b, 1, h, c // h).transpose(1, 2)
        k = attn.k(tokens).reshape(b, n, h, c // h).transpose(1, 2)
    return torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1).mean(1)[:, 0]


def _forward_with_norm1(model, norm1, replace=None):
    """Run the whole model; record (or replace) the last block's first-norm output."""
    kept = []

    def hook(module, args, output):
        out = replace if replace is not None else output
        if out.requires_grad:
            out.retain_grad()
        kept.append(out)
        return out

    handle = model.get_submodule(norm1).register_forward_hook(hook)
    try:
        return model(X), kept[0]
    finally:
        handle.remove()


X = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def test_methods_listed_and_refused_with_reason(case):
    name, model = case
    ex = vx.Explainer(model)
    listed = ex.methods()
    assert "rollout" not in listed and "generic" not in listed and "grad_rollout" not in listed
    assert {"raw", "attn_gradcam", "cdam", "gradcam", "cdam_smooth", "cdam_integrated", "legrad"} <= set(listed)
    assert vx.methods.names(ex) == listed and ex.plan(method=listed).names == listed
    assert ex.adapter.blocks[-1] == ATTENTION_BLOCKS[name]
    for method in ("rollout", "generic", "grad_rollout"):
        with pytest.raises(vx.UnsupportedMethodError, match=WHY[name]):
            ex.explain(X, method=method)


def test_raw_cdam_and_integrated_match_oracles(case):
    name, model = case
    ex = vx.Explainer(model)
    steps = 8
    results = {e.method: e for e in ex.explain(X, method=["raw", "cdam", "cdam_integrated", "cdam_smooth", "legrad"], cdam_integrated={"steps": steps}, cdam_smooth={"samples": 4})}
    targets = results["cdam"].targets
    norm1 = ex.adapter.norm1
    block = model.get_submodule(ATTENTION_BLOCKS[name])

    logits, tokens = _forward_with_norm1(model, norm1)
    raw = _hand_attention(block, tokens.detach())[:, 1:].reshape(2, *GRID)
    torch.testing.assert_close(results["raw"].maps, raw, atol=1e-6, rtol=1e-4)

    logits.gather(1, targets[:, None]).sum().backward()
    cdam = (tokens * tokens.grad).sum(-1)[:, 1:].reshape(2, *GRID)
    torch.testing.assert_close(results["cdam"].maps, cdam.detach(), atol=1e-6, rtol=1e-4)

    # integrated CDAM: midpoint rule along alpha * T with the rest of the model as it is
    t = tokens.detach()
    mean_grad = torch.zeros_like(t)
    for k in range(steps):
        point = ((k + 0.5) / steps * t).requires_grad_(True)
        out, _ = _forward_with_norm1(model, norm1, replace=point)
        (g,) = torch.autograd.grad(out.gather(1, targets[:, None]).sum(), point)
        mean_grad += g / steps
    integrated = (t * mean_grad).sum(-1)[:, 1:].reshape(2, *GRID)
    torch.testing.assert_close(results["cdam_integrated"].maps, integrated, atol=1e-6, rtol=1e-4)
    for method in ("cdam_smooth", "legrad"):
        maps = results[method].maps
        assert maps.shape == (2, *GRID) and torch.isfinite(maps).all()
    # (LeGrad may be all zero on a random XCiT: every patch key's gradient is negative there)
    assert float(results["cdam_smooth"].maps.std()) > 0


def test_a_partial_forward_that_does_not_reproduce_the_model_is_refused():
    # the pre-issue adapter for CaiT: its "last block" was the last patch block, so the re-run
    # skipped the class-attention blocks and smooth/integrated CDAM were silently wrong
    torch.manual_seed(0)
    model = _sharpen(BUILDS["cait"]())
    wrong = TimmViTAdapter(model)
    ex = vx.Explainer(model, adapter=wrong)
    for method in ("cdam_smooth", "cdam_integrated"):
        with pytest.raises(vx.UnsupportedModelError, match="does not reproduce the model's own outputs"):
            ex.explain(X, method=method)


@pytest.mark.parametrize("pool", ["max", "avgmax"])
def test_a_max_pooling_head_refuses_the_methods_that_carry_a_readout_row(pool):
    """Each channel of a max-pooled head reads its own token, so no row of token weights (the class row, or 1/N
    for average pooling) is what the head reads: the methods that carry one through the attention are refused
    with the reason, and the gradient methods through the head itself still run (CDAM: its own definition, the
    gradient of the score with respect to the tokens entering the last block, times those tokens, summed)."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=3, global_pool=pool).eval()
    ex = vx.Explainer(model)
    refused = {"raw", "rollout", "grad_rollout", "generic", "attn_gradcam"}
    assert refused.isdisjoint(ex.methods()) and "cdam" in ex.methods()
    for method in sorted(refused):
        with pytest.raises(vx.UnsupportedMethodError, match=rf"global_pool='{pool}'.*no one row of token weights"):
            ex.plan(method)
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    kept = {}
    handle = model.blocks[-1].norm1.register_forward_hook(lambda m, i, o: kept.update(t=o))
    try:
        out = model(x)
        grad, = torch.autograd.grad(out[:, 1].sum(), kept["t"])
    finally:
        handle.remove()
    want = (grad * kept["t"]).sum(-1)[:, model.num_prefix_tokens:].reshape(2, 2, 2).detach()
    got = ex.explain(x, method="cdam", target=1).maps
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
    assert "rollout" in vx.Explainer(timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=3,
                                                       global_pool="avg").eval()).methods()
