"""FlexAttention capture: probabilities with score_mod and block masks, raw/rollout, errors.

Oracles: an eager twin of each model (the same weights, the relative-position bias and the
window written as a dense masked softmax in Python, captured at its softmax), hand-written
dense formulas, and torch's own math path for FlexAttention (``_math_attention_inner``).
"""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
from torch import nn

import vitexplain as vx
from vitexplain.errors import CaptureError

timm = pytest.importorskip("timm")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
from timm.layers import Attention  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402
from torch._higher_order_ops.flex_attention import _math_attention_inner  # noqa: E402

MAX_N = 17  # class token + 4 x 4 patches
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


class FlexRelPosAttention(Attention):
    """timm's attention calling ``flex_attention`` with a learned relative-position bias (score_mod)
    and, when ``window`` is set, a sliding-window block mask (|i - j| <= window)."""

    window: Optional[int] = None
    use_flex = True
    flex_fn = staticmethod(flex.flex_attention)

    def __init__(self, dim: int, num_heads: int = 8, **kwargs) -> None:
        super().__init__(dim, num_heads=num_heads, **kwargs)
        self.rel_bias = nn.Parameter(torch.randn(num_heads, 2 * MAX_N - 1))

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        bias, w = self.rel_bias, self.window
        if self.use_flex:
            def rel_pos(score, bi, h, qi, ki):
                return score + bias[h, qi - ki + MAX_N - 1]

            mask = None
            if w is not None:
                mask = flex.create_block_mask(lambda bi, h, qi, ki: (qi - ki).abs() <= w, None, None, n, n, device=x.device)
            out = self.flex_fn(q, k, v, score_mod=rel_pos, block_mask=mask)
        else:  # the eager twin: the same attention as a dense masked softmax
            i = torch.arange(n)
            scores = q @ k.transpose(-2, -1) * self.scale + bias[:, i[:, None] - i[None] + MAX_N - 1]
            if w is not None:
                scores = scores.masked_fill((i[:, None] - i[None]).abs() > w, float("-inf"))
            out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class FlexWindowAttention(FlexRelPosAttention):
    window = 2


def flex_vit(attn_layer: type = FlexRelPosAttention) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, attn_layer=attn_layer
    ).eval()


def eager_twin(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, FlexRelPosAttention):
            m.use_flex = False
    return twin


@pytest.mark.parametrize("attn_layer", [FlexRelPosAttention, FlexWindowAttention], ids=["relpos", "window"])
def test_flex_probs_match_eager_twin_and_torch_math_path(attn_layer):
    model = flex_vit(attn_layer)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        plain = model(x)
        with vx.capture(model) as rec:
            captured = model(x)
        twin = eager_twin(model)
        with vx.capture(twin) as ref:
            expected_out = twin(x)
    torch.testing.assert_close(captured, plain, atol=0, rtol=0)  # the capture does not change the output
    torch.testing.assert_close(captured, expected_out, atol=1e-5, rtol=1e-5)
    assert [r.name for r in rec.records] == ["blocks.0.attn", "blocks.1.attn"]
    assert all(r.source == "flex" and r.kind == "self" for r in rec.records)
    for r, e in zip(rec.records, ref.records):
        assert e.source == "eager"
        torch.testing.assert_close(r.probs(), e.probs(), atol=1e-5, rtol=0)
        torch.testing.assert_close(r.probs(queries=slice(3, 7)), e.probs()[:, :, 3:7], atol=1e-5, rtol=0)
        # torch's own dense math path (scores with score_mod, mask_mod applied as -inf)
        mask_mod = r.block_mask.mask_mod if r.block_mask is not None else flex.noop_mask
        _, post = _math_attention_inner(r._q, r._k, r._q, r.score_mod, (mask_mod,), r._q.shape[-1] ** -0.5, {})
        math_probs = torch.nan_to_num(post.softmax(-1), nan=0.0)
        assert (r.probs() - math_probs).abs().max().item() < 1e-5
    if attn_layer is FlexWindowAttention:
        probs = rec.records[0].probs()
        far = (torch.arange(MAX_N)[:, None] - torch.arange(MAX_N)[None]).abs() > 2
        assert torch.all(probs[..., far] == 0)  # masked entries are exactly 0
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, MAX_N))


@pytest.mark.parametrize("attn_layer", [FlexRelPosAttention, FlexWindowAttention], ids=["relpos", "window"])
def test_raw_and_rollout_on_flex_models_equal_the_eager_twin(attn_layer):
    model = flex_vit(attn_layer)
    x = torch.randn(3, 3, 32, 32)
    want = vx.Explainer(eager_twin(model)).explain(x, method=["raw", "rollout"])
    # the model, and the model compiled (the capture runs compiled models eagerly, FlexAttention included)
    for explained in (model, torch.compile(model)):
        got = vx.Explainer(explained).explain(x, method=["raw", "rollout"])
        for g, w in zip(got, want):
            assert g.maps.shape == (3, 4, 4)
            torch.testing.assert_close(g.maps, w.maps, atol=1e-5, rtol=1e-4)


def test_gradients_on_cpu_raise_a_clear_error_and_leave_the_model_as_found():
    model = flex_vit()
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(CaptureError, match="no backward pass on CPU"):
        vx.Explainer(model).explain(x, method="grad_rollout")
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(not p.grad is not None for p in model.parameters())
    with torch.no_grad():  # still usable afterwards
        vx.Explainer(model).explain(x, method="rollout")


def test_compiled_flex_attention_is_captured():
    """``torch.compile(flex_attention)`` inside the module (the usual way to get the fused kernel).

    The ``eager`` backend keeps the test fast: dynamo traces the call (and the capture's
    recording of it) exactly as it does for the inductor kernel.
    """

    class Compiled(FlexRelPosAttention):
        flex_fn = staticmethod(torch.compile(flex.flex_attention, backend="eager"))

    model = flex_vit(Compiled)
    x = torch.randn(2, 3, 32, 32)
    for _ in range(2):  # the second forward runs the cached compiled code
        with torch.no_grad(), vx.capture(model) as rec:
            model(x)
        assert [(r.name, r.source) for r in rec.records] == [("blocks.0.attn", "flex"), ("blocks.1.attn", "flex")]
    twin = eager_twin(model)
    with torch.no_grad(), vx.capture(twin) as ref:
        twin(x)
    for r, e in zip(rec.records, ref.records):
        torch.testing.assert_close(r.probs(), e.probs(), atol=1e-5, rtol=0)
    # a whole compiled model: its submodules are compiled into one forward, so no call can be attributed
    plain = flex_vit()
    whole = torch.compile(plain, backend="eager")
    with pytest.raises(CaptureError, match="cannot be told apart"):
        with torch.no_grad(), vx.capture(plain):
            whole(x)


def test_compiled_flex_attention_across_sizes_matches_the_dense_formula():
    """New sequence lengths make dynamo recompile with symbolic sizes; the calls are still recorded."""
    compiled = torch.compile(flex.flex_attention, backend="eager")
    bias = torch.randn(2, 80)

    class Local(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            n = q.shape[-2]
            mask = flex.create_block_mask(lambda b, h, qi, ki: (qi - ki).abs() <= 2, None, None, n, n, device="cpu")
            out = compiled(q, q, q, score_mod=lambda s, b, h, qi, ki: s + bias[h, qi - ki + 39], block_mask=mask, scale=0.3)
            return out.sum(-1)

    model = Local()
    for n in (17, 8, 24):
        q = torch.randn(1, 2, n, 4)
        with torch.no_grad(), vx.capture(model) as rec:
            model(q)
        i = torch.arange(n)
        scores = q @ q.transpose(-1, -2) * 0.3 + bias[:, i[:, None] - i[None] + 39]
        expected = scores.masked_fill((i[:, None] - i[None]).abs() > 2, float("-inf")).softmax(-1)
        torch.testing.assert_close(rec.records[0].probs(), expected, atol=1e-6, rtol=0)


def test_block_mask_that_disagrees_with_its_mask_mod_is_refused():
    q, k, v = torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    blocks = flex.BlockMask.from_kv_blocks(
        torch.tensor([[[1, 1]]], dtype=torch.int32), torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32),
        BLOCK_SIZE=4, seq_lengths=(8, 8),
    )  # block-diagonal blocks, no mask_mod: the unfused path attends everywhere, kernels do not

    class Block(nn.Module):
        def forward(self, q, k, v):
            return flex.flex_attention(q, k, v, block_mask=blocks)

    block = Block()
    with vx.capture(block) as rec:
        block(q, k, v)
    with pytest.raises(CaptureError, match="disagree with its mask_mod"):
        rec.records[0].probs()



def test_a_compiled_call_whose_output_leaves_the_capture_unused_is_reported():
    compiled = torch.compile(flex.flex_attention, backend="eager")

    class Last(nn.Module):  # returns the compiled call's output untouched: no later op names the issuer
        def forward(self, q, k, v):
            return compiled(q, k, v)

    class Eager(Last):
        def forward(self, q, k, v):
            return flex.flex_attention(q, k, v)

    q = torch.randn(1, 1, 8, 4)
    eager = Eager()
    with vx.capture(eager) as rec:
        eager(q, q, q)
    assert [r.name for r in rec.records] == [""]  # eager calls are seen at their own frame
    last = Last()
    with vx.capture(last) as rec:
        last(q, q, q)
    with pytest.raises(CaptureError, match="not attributed"):
        rec.records


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention has a backward on CUDA only")
@pytest.mark.parametrize("attn_layer", [FlexRelPosAttention, FlexWindowAttention], ids=["relpos", "window"])
def test_gradient_methods_on_cuda_equal_the_eager_twin(attn_layer):
    model = flex_vit(attn_layer).cuda()
    x = torch.randn(2, 3, 32, 32, device="cuda")
    methods = ["grad_rollout", "generic", "attn_gradcam"]
    got = vx.Explainer(model).explain(x, method=methods, target=1)
    want = vx.Explainer(eager_twin(model)).explain(x, method=methods, target=1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.maps, w.maps, atol=1e-4, rtol=1e-3)
