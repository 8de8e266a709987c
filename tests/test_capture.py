"""vx.capture: recomputed probabilities and gradients match eager attention, model untouched.

The eager references below never use vitexplain code: they switch a copy of the model to
its Python attention path (timm ``fused_attn=False``, Hugging Face "eager",
``nn.MultiheadAttention(need_weights=True)``) and read the probabilities the model itself
computes, via hooks on the attention dropout module.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitexplain as vx
from vitexplain.errors import CaptureError, NoAttentionError

import timm  # noqa: E402,F401  (a dependency of the package: never skipped)
from timm.models.beit import Beit  # noqa: E402
from timm.models.eva import Eva  # noqa: E402
from timm.models.swin_transformer import SwinTransformer  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402
from timm.models.deit import VisionTransformerDistilled  # noqa: E402

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


def timm_models() -> dict[str, nn.Module]:
    return {
        "vit": VisionTransformer(**TINY),
        "vit_reg": VisionTransformer(**TINY, reg_tokens=2),
        "vit_avg": VisionTransformer(**TINY, class_token=False, global_pool="avg"),
        "deit_distilled": VisionTransformerDistilled(**TINY),
        "eva_rope": Eva(**TINY, use_rot_pos_emb=True),
        "beit_relpos": Beit(**TINY, use_rel_pos_bias=True),
        "swin_shifted": SwinTransformer(
            img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 2), num_classes=5
        ),
    }


def eager_reference(model: nn.Module, x: torch.Tensor, *, grad_class: int | None = None):
    """Run a deep copy of a timm model in eager attention; return (output, probs list)."""
    ref = copy.deepcopy(model)
    probs: list[torch.Tensor] = []

    def keep(module, args, output):
        if output.requires_grad:
            output.retain_grad()
        probs.append(output)

    for module in ref.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = False
            module.attn_drop.register_forward_hook(keep)
    x = x.detach().clone().requires_grad_(grad_class is not None)
    out = ref(x)
    if grad_class is not None:
        out[:, grad_class].sum().backward()
    return out, probs


def set_fused(model: nn.Module, fused: bool) -> None:
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = fused


@pytest.mark.parametrize("name", list(timm_models()))
def test_timm_probs_match_eager_and_output_is_bit_identical(name):
    model = timm_models()[name].eval()
    set_fused(model, True)  # Swin defaults to eager; exercise its SDPA path with masks
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        plain = model(x)
        with vx.capture(model) as rec:
            captured = model(x)
        ref_out, ref_probs = eager_reference(model, x)
    assert torch.equal(plain, captured)
    assert len(rec.records) == len(ref_probs) > 0
    for record, expected in zip(rec.records, ref_probs):
        got = record.probs()
        assert got.dtype == torch.float32
        assert record.source == "sdpa" and record.kind == "self"
        torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=0)
    assert torch.allclose(ref_out, plain, atol=1e-4)


def test_eager_timm_modules_are_captured_too():
    model = VisionTransformer(**TINY).eval()
    set_fused(model, False)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), vx.capture(model) as rec:
        model(x)
    _, ref_probs = eager_reference(model, x)
    assert [r.name for r in rec.records] == ["blocks.0.attn", "blocks.1.attn"]
    for record, expected in zip(rec.records, ref_probs):
        assert record.source == "eager"
        torch.testing.assert_close(record.probs(), expected, atol=1e-6, rtol=0)


def test_swin_default_eager_softmax_is_attributed_to_the_attention_module():
    model = timm_models()["swin_shifted"].eval()  # timm Swin uses nn.Softmax in eager mode
    with torch.no_grad(), vx.capture(model) as rec:
        model(torch.randn(1, 3, 32, 32))
    assert rec.records[0].name == "layers.0.blocks.0.attn"
    assert all(r.name.endswith(".attn") for r in rec.records)


def test_record_names_order_and_shapes():
    model = VisionTransformer(**TINY).eval()
    with torch.no_grad(), vx.capture(model) as rec:
        model(torch.randn(3, 3, 32, 32))
    assert [r.name for r in rec.records] == ["blocks.0.attn", "blocks.1.attn"]
    assert [r.index for r in rec.records] == [0, 1]
    assert rec.records[0].q_shape == (3, 2, 17, 16) and rec.records[0].k_shape == (3, 2, 17, 16)
    assert rec.records[0].probs().shape == (3, 2, 17, 17)
    # query blocks give the same rows as the full matrix
    full = rec.records[1].probs()
    torch.testing.assert_close(rec.records[1].probs(queries=slice(3, 9)), full[:, :, 3:9])
    torch.testing.assert_close(rec.records[1].probs(queries=0), full[:, :, :1])
    torch.testing.assert_close(rec.records[1].fused_probs("max"), full.amax(1))


def test_grad_probs_match_eager_attention_gradient_timm():
    model = VisionTransformer(**TINY).eval()
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    with vx.capture(model, grads=True) as rec:
        out = model(x)
    out[:, 3].sum().backward()
    _, ref_probs = eager_reference(model, x, grad_class=3)
    for record, expected in zip(rec.records, ref_probs):
        got = record.grad_probs()
        scale = expected.grad.abs().max()
        assert ((got - expected.grad).abs().max() / scale) < 1e-5
    # grads of a subset of query rows
    torch.testing.assert_close(rec.records[0].grad_probs(queries=0), rec.records[0].grad_probs()[:, :, :1])


class MHAEncoder(nn.Module):
    """Self-attention then cross-attention through nn.MultiheadAttention."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x, x, x, need_weights=False)[0]
        x = x + self.cross_attn(x, memory, memory, need_weights=False)[0]
        return self.head(x).mean(1)


def mha_eager(module: MHAEncoder, x: torch.Tensor, memory: torch.Tensor):
    """Same forward with need_weights=True (eager softmax); returns output and weights."""
    a, w1 = module.self_attn(x, x, x, need_weights=True, average_attn_weights=False)
    x = x + a
    b, w2 = module.cross_attn(x, memory, memory, need_weights=True, average_attn_weights=False)
    x = x + b
    return module.head(x).mean(1), [w1, w2]


def test_mha_probs_kinds_and_fast_path_restored():
    model = MHAEncoder().eval()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    fast = torch.backends.mha.get_fastpath_enabled()
    with torch.no_grad(), vx.capture(model) as rec:
        assert torch.backends.mha.get_fastpath_enabled() is False
        out = model(x, memory)
    assert torch.backends.mha.get_fastpath_enabled() is fast
    # bit-identical to the same model on its non-fast path (the path used inside the scope)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            plain = model(x, memory)
            _, weights = mha_eager(model, x, memory)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    assert torch.equal(out, plain)
    assert [(r.name, r.kind, r.source) for r in rec.records] == [
        ("self_attn", "self", "sdpa"),
        ("cross_attn", "cross", "sdpa"),
    ]
    for record, expected in zip(rec.records, weights):
        torch.testing.assert_close(record.probs(), expected, atol=1e-6, rtol=0)


def test_mha_need_weights_true_is_recorded_as_eager():
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    with torch.no_grad(), vx.capture(mha) as rec:
        _, averaged = mha(x, memory, memory)  # default need_weights=True, head-averaged
    (record,) = rec.records
    assert record.source == "eager" and record.kind == "cross"
    torch.testing.assert_close(record.probs().mean(1), averaged, atol=1e-6, rtol=0)


def manual_mha(mha: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor):
    """nn.MultiheadAttention written out by hand (batch_first); returns (output, A)."""
    d, h = mha.embed_dim, mha.num_heads
    w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    b_q, b_k, b_v = mha.in_proj_bias.chunk(3)

    def split(t):
        return t.view(t.shape[0], t.shape[1], h, d // h).transpose(1, 2)

    q, k, v = split(query @ w_q.T + b_q), split(key @ w_k.T + b_k), split(key @ w_v.T + b_v)
    attn = torch.softmax(q @ k.transpose(-2, -1) / (d // h) ** 0.5, dim=-1)
    attn.retain_grad()
    out = (attn @ v).transpose(1, 2).reshape(query.shape)
    return mha.out_proj(out), attn


def test_grad_probs_match_eager_for_mha():
    model = MHAEncoder().eval()
    x, memory = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 7, 16)
    with vx.capture(model, grads=True) as rec:
        out = model(x, memory)
    out[:, 1].sum().backward()
    x2 = x.detach().clone().requires_grad_()
    a, attn_self = manual_mha(model.self_attn, x2, x2)
    y = x2 + a
    b, attn_cross = manual_mha(model.cross_attn, y, memory)
    ref_out = model.head(y + b).mean(1)
    torch.testing.assert_close(ref_out, out, atol=1e-5, rtol=0)
    ref_out[:, 1].sum().backward()
    for record, expected in zip(rec.records, (attn_self, attn_cross)):
        torch.testing.assert_close(record.probs(), expected.detach(), atol=1e-6, rtol=0)
        got = record.grad_probs()
        assert ((got - expected.grad).abs().max() / expected.grad.abs().max()) < 1e-5


def test_transformer_decoder_cross_attention_and_causal_mask():
    layer = nn.TransformerDecoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    decoder = nn.TransformerDecoder(layer, num_layers=2).eval()
    tgt, memory = torch.randn(2, 6, 16), torch.randn(2, 9, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    with torch.no_grad(), vx.capture(decoder) as rec:
        decoder(tgt, memory, tgt_mask=causal, tgt_is_causal=True)
    assert [(r.name, r.kind) for r in rec.records] == [
        ("layers.0.self_attn", "self"),
        ("layers.0.multihead_attn", "cross"),
        ("layers.1.self_attn", "self"),
        ("layers.1.multihead_attn", "cross"),
    ]
    # eager reference: feed each attention module its recorded inputs with need_weights=True
    inputs: list[tuple] = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, kw: inputs.append((mod, args, kw)), with_kwargs=True)
        for m in decoder.modules()
        if isinstance(m, nn.MultiheadAttention)
    ]
    with torch.no_grad():
        decoder(tgt, memory, tgt_mask=causal, tgt_is_causal=True)
    for h in hooks:
        h.remove()
    for record, (mod, args, kw) in zip(rec.records, inputs):
        kw = {**kw, "need_weights": True, "average_attn_weights": False, "is_causal": False}
        with torch.no_grad():
            _, expected = mod(*args, **kw)
        torch.testing.assert_close(record.probs(), expected, atol=1e-6, rtol=0)
    probs = rec.records[0].probs()
    assert torch.all(probs[..., 0, 1:] == 0), "causal rows must not see the future"


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, d)


def test_is_causal_flag_recomputes_lower_triangular_probs():
    attn = CausalSelfAttention().eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), vx.capture(attn) as rec:
        attn(x)
    q, k, _ = attn.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-2, -1)) / 8**0.5
    scores = scores.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    torch.testing.assert_close(rec.records[0].probs(), scores.softmax(-1), atol=1e-6, rtol=0)


def test_probs_are_float32_for_bfloat16_models():
    model = VisionTransformer(**TINY).eval().to(torch.bfloat16)
    x = torch.randn(1, 3, 32, 32, dtype=torch.bfloat16)
    with torch.no_grad(), vx.capture(model) as rec:
        model(x)
    _, ref_probs = eager_reference(model, x)
    probs = rec.records[0].probs()
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)))
    torch.testing.assert_close(probs, ref_probs[0].float(), atol=2e-2, rtol=0)


def test_grads_under_no_grad_raise_clear_error():
    model = VisionTransformer(**TINY).eval()
    with torch.no_grad(), vx.capture(model, grads=True) as rec:
        model(torch.randn(1, 3, 32, 32))
    assert rec.records[0].probs().shape == (1, 2, 17, 17)  # forward-only use works
    with pytest.raises(CaptureError, match="no_grad"):
        rec.records[0].grad_probs()
    with torch.no_grad(), vx.capture(model) as rec:
        model(torch.randn(1, 3, 32, 32))
    with pytest.raises(CaptureError, match="grads=True"):
        rec.records[0].grad_probs()


def test_grad_before_backward_raises():
    model = VisionTransformer(**TINY).eval()
    with vx.capture(model, grads=True) as rec:
        model(torch.randn(1, 3, 32, 32, requires_grad=True))
    with pytest.raises(CaptureError, match="backward"):
        rec.records[0].grad_probs()


def test_no_attention_errors_name_the_model():
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    with torch.no_grad(), vx.capture(cnn) as rec:
        cnn(torch.randn(1, 3, 8, 8))
    with pytest.raises(NoAttentionError, match="Sequential.*scaled_dot_product_attention"):
        rec.records
    with vx.capture(cnn) as rec:
        pass
    with pytest.raises(NoAttentionError, match="no forward"):
        rec.records


def snapshot(model: nn.Module) -> dict:
    return {
        name: (
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            len(m._backward_hooks),
            m.training,
            getattr(m, "fused_attn", None),
            "forward" in m.__dict__,
        )
        for name, m in model.named_modules()
    } | {"requires_grad": [p.requires_grad for p in model.parameters()]}


def test_model_restored_after_normal_exit_and_after_exception():
    model = VisionTransformer(**TINY)
    model.blocks[1].attn.fused_attn = False
    model.blocks[0].requires_grad_(False)
    model.train()
    before = snapshot(model)
    fast = torch.backends.mha.get_fastpath_enabled()
    with vx.capture(model, grads=True, activations=["blocks.1.norm1"]) as rec:
        model(torch.randn(1, 3, 32, 32)).sum()
    assert snapshot(model) == before
    with pytest.raises(ZeroDivisionError):
        with vx.capture(model, grads=True, activations=["blocks.1.norm1"]):
            model(torch.randn(1, 3, 32, 32))
            1 / 0
    assert snapshot(model) == before
    assert torch.backends.mha.get_fastpath_enabled() is fast
    assert all(p.grad is None for p in model.parameters()), "the capture itself must not create .grad"
    assert len(rec.records) == 2


def test_exception_inside_model_forward_restores_too():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = VisionTransformer(**TINY)

        def forward(self, x):
            self.inner(x)
            raise RuntimeError("boom")

    model = Broken().eval()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        with vx.capture(model):
            model(torch.randn(1, 3, 32, 32))
    assert snapshot(model) == before


def test_nested_and_repeated_captures_and_two_models_do_not_mix():
    a, b = VisionTransformer(**TINY).eval(), VisionTransformer(**{**TINY, "depth": 3}).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        with vx.capture(a) as outer:
            with vx.capture(a) as inner:
                a(x)
            b(x)  # b is not captured by `outer`
        assert len(outer.records) == len(inner.records) == 2
        with vx.capture(b) as rb:
            b(x)
        with vx.capture(a) as ra:
            a(x)
            a(x)
    assert len(rb.records) == 3 and len(ra.records) == 4
    assert [r.step for r in ra.records] == [0, 0, 1, 1]
    assert len(ra.select(step=1)) == 2 and len(ra.select(prefix="blocks.0")) == 2


def test_activations_and_their_gradients():
    model = VisionTransformer(**TINY).eval()
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    with vx.capture(model, grads=True, activations=["blocks.1.norm1"]) as rec:
        out = model(x)
    out[:, 2].sum().backward(retain_graph=True)
    act = rec.activation("blocks.1.norm1")
    kept = []
    handle = model.blocks[1].norm1.register_forward_hook(lambda m, a, o: (o.retain_grad(), kept.append(o))[0])
    model(x.detach())[:, 2].sum().backward()
    handle.remove()
    torch.testing.assert_close(act.output, kept[0])
    torch.testing.assert_close(act.grad, kept[0].grad)
    assert act.input.shape == act.output.shape == (2, 17, 32)
    # a second backward accumulates (like .grad); zero_grad() clears
    out[:, 2].sum().backward()
    torch.testing.assert_close(act.grad, 2 * kept[0].grad)
    rec.zero_grad()
    assert act.grad is None and rec.records[0]._grad_out is None
    with pytest.raises(CaptureError, match="no module named"):
        with vx.capture(model, activations=["blocks.9.norm1"]):
            pass


@pytest.mark.parametrize(
    "model, size, prefix, grid, has_cls, readout",
    [
        (lambda: VisionTransformer(**TINY), (32, 32), 1, (4, 4), True, "class"),
        (lambda: VisionTransformer(**TINY, reg_tokens=4), (32, 32), 5, (4, 4), True, "class"),
        (lambda: VisionTransformer(**TINY, class_token=False, global_pool="avg"), (32, 32), 0, (4, 4), False, "mean"),
        (lambda: VisionTransformer(**TINY, dynamic_img_size=True), (48, 24), 1, (6, 3), True, "class"),
        (lambda: VisionTransformerDistilled(**TINY), (32, 32), 2, (4, 4), True, "prefix"),  # its two heads averaged
        (lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False), (224, 224), 1, (14, 14), True, "class"),
        (lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=(224, 160)), (224, 160), 1, (14, 10), True, "class"),
    ],
)
def test_layout_prefix_and_grid(model, size, prefix, grid, has_cls, readout):
    m = model().eval()
    layout = vx.token_layout(m, size)
    assert (layout.num_prefix_tokens, layout.grid, layout.has_class_token, layout.readout) == (
        prefix,
        grid,
        has_cls,
        readout,
    )
    with torch.no_grad(), vx.capture(m) as rec:
        m(torch.randn(1, 3, *size))
    assert rec.layout == layout
    assert rec.records[0].num_keys == layout.num_tokens  # the grid is the one the model used


def test_layout_torchvision_and_unknown_models():
    # (the windowed Swin layout is tested with the Swin adapter, tests/test_swin.py)
    import torchvision as tv
    m = tv.models.VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32)
    layout = vx.token_layout(m, 32)
    assert (layout.num_prefix_tokens, layout.grid, layout.has_class_token) == (1, (4, 4), True)
    with pytest.raises(vx.UnsupportedModelError, match="token layout"):
        vx.token_layout(nn.Conv2d(3, 3, 1), 32)


def test_the_recorder_takes_its_layout_from_layout_fn_and_vx_capture_gives_the_adapters():
    x = torch.randn(1, 3, 48, 32)
    asked = []

    def layout_fn(model, size):
        asked.append((model, size))
        return vx.TokenLayout(1, (size[0] // 8, size[1] // 8), True)

    dynamic = VisionTransformer(**TINY, dynamic_img_size=True).eval()
    with torch.no_grad():
        with vx.recording.capture(dynamic) as low:  # the recorder alone recognises no model
            dynamic(x)
        with vx.recording.capture(dynamic, layout_fn=layout_fn) as given:
            dynamic(x)
        with vx.capture(dynamic) as front:
            dynamic(x)
    with pytest.raises(CaptureError, match=r"vx\.capture\(model\)"):
        low.layout
    assert given.layout.grid == (6, 4) and asked == [(dynamic, (48, 32))]
    assert front.layout == vx.token_layout(dynamic, (48, 32)) and front.layout.grid == (6, 4)


def test_torchvision_vit_probs_match_eager():
    import torchvision as tv
    m = tv.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32).eval()
    x = torch.randn(2, 3, 32, 32)
    inputs: list = []
    hooks = [
        blk.self_attention.register_forward_pre_hook(lambda mod, a: inputs.append((mod, a)))
        for blk in m.encoder.layers
    ]
    with torch.no_grad(), vx.capture(m) as rec:
        m(x)
    for h in hooks:
        h.remove()
    assert [r.name for r in rec.records] == [
        "encoder.layers.encoder_layer_0.self_attention",
        "encoder.layers.encoder_layer_1.self_attention",
    ]
    for record, (mod, args) in zip(rec.records, inputs):
        with torch.no_grad():
            _, expected = mod(*args, need_weights=True, average_attn_weights=False)
        torch.testing.assert_close(record.probs(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", ["fused", "materialize"])
def test_gradient_captures_are_freed_when_dropped(mode, monkeypatch) -> None:
    """A gradient capture's records, recorder and autograd graph are freed once the user drops
    them (the gradient hooks sit in autograd's C++ graph, where a reference back to the record
    would be a cycle Python's collector cannot see: every explain call would leak its graph)."""
    import gc
    import weakref

    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    with vx.capture(model, grads=True, activations=["blocks.1"], attention_mode=mode) as rec:
        out = model(x)
    rec.backward(out[:, 1].sum())
    assert rec.records[0].grad_probs().shape == (2, 2, 17, 17)  # the hooks did deliver
    refs = [weakref.ref(rec), weakref.ref(rec.records[0]), weakref.ref(rec.activations["blocks.1"][0]),
            weakref.ref(rec.records[0].output)]
    del rec, out
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    # the records an explain call makes inside itself: tracked by weak references taken as
    # each is built (scoped to this test), not by scanning every object of the process
    made: "weakref.WeakSet" = weakref.WeakSet()
    built = []
    init = vx.recording.AttentionRecord.__init__

    def tracked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.add(self)
        built.append(1)

    monkeypatch.setattr(vx.recording.AttentionRecord, "__init__", tracked_init)
    ex = vx.Explainer(model, attention_mode=mode)
    ex.explain(x, method=["generic", "gradcam", "legrad"])
    gc.collect()
    assert built and len(made) == 0, f"{len(made)} of {len(built)} records outlive the explain call"


def test_a_model_run_only_in_another_thread_is_reported_as_such():
    """The capture's mode is thread-local: a forward in another thread records nothing. The error used to
    say that the model has no attention the capture can observe (advising CNN methods); it now says why."""
    import threading

    model = VisionTransformer(**TINY).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad(), vx.capture(model) as rec:
        thread = threading.Thread(target=lambda: model(x))
        thread.start()
        thread.join()
    with pytest.raises(NoAttentionError, match="another thread"):
        rec.records
    assert rec.forward_count == 0 and rec.input_size is None  # (the other thread's call is not this capture's)
    with torch.no_grad(), vx.capture(model) as rec:  # the same model in the scope's thread: recorded
        model(x)
    assert len(rec.records) == 2 and rec.forward_count == 1


@pytest.mark.parametrize("path", ["fused", "materialize", "eager"])
def test_gradient_checkpointing_records_each_call_once(path):
    """timm's set_grad_checkpointing (active in eval mode too) recomputes each block in the backward pass;
    a backward inside the scope recorded every attention call again (4 records for 2 layers, the last
    two in reverse order, their activations twice), and a materializing capture failed torch's check that
    the recomputation equals the forward. Oracle: the same model without checkpointing."""
    torch.manual_seed(0)
    model = VisionTransformer(**TINY).eval()
    if path == "eager":
        for block in model.blocks:
            block.attn.fused_attn = False
    x = torch.randn(2, 3, 32, 32)
    mode = "materialize" if path == "materialize" else "fused"
    runs = []
    for checkpointing in (False, True):
        model.set_grad_checkpointing(checkpointing)
        with vx.capture(model, grads=True, attention_mode=mode, activations=["blocks.1"]) as rec:
            rec.backward(model(x)[:, 1])
        runs.append(rec)
    plain, checkpointed = runs
    assert [(r.name, r.step) for r in checkpointed.records] == [("blocks.0.attn", 0), ("blocks.1.attn", 0)]
    assert len(checkpointed.activations["blocks.1"]) == 1
    for got, want in zip(checkpointed.records, plain.records):
        torch.testing.assert_close(got.probs(), want.probs(), atol=1e-6, rtol=0)
        torch.testing.assert_close(got.grad_probs(), want.grad_probs(), atol=1e-6, rtol=0)
    torch.testing.assert_close(checkpointed.activations["blocks.1"][0].grad, plain.activations["blocks.1"][0].grad)


def test_checkpointed_declared_module_is_recorded_once():
    """torch.utils.checkpoint (reentrant or not) around a module declared with an extractor: one record per call."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()

    class Wrapped(nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.attn, self.reentrant = mha, reentrant

        def forward(self, x):
            return checkpoint(lambda t: self.attn(t, t, t)[0], x, use_reentrant=self.reentrant)

    x = torch.randn(2, 5, 8, requires_grad=True)
    for reentrant in (False, True):
        model = Wrapped(reentrant)
        with vx.capture(model, attention={"attn": lambda m, i, o: o[1]}) as rec:
            model(x).sum().backward()  # (recomputes the checkpointed call)
        (record,) = rec.records
        want = mha(x, x, x, average_attn_weights=True)[1]
        torch.testing.assert_close(record.probs()[:, 0], want, atol=1e-6, rtol=0)


def test_nested_captures_backward_passes_do_not_reach_each_other():
    """An inner capture's rec.backward (e.g. an explainer's, inside a user's capture) reached the outer
    capture's hooks too, and the outer's reached the inner's: both got twice dy/dA after one backward
    each. Oracle: dy/dA on the eager twin's own probabilities (torch.autograd.grad)."""
    torch.manual_seed(0)
    model = VisionTransformer(**TINY).eval()
    x = torch.randn(2, 3, 32, 32)
    twin = copy.deepcopy(model)
    probs = []
    for block in twin.blocks:
        block.attn.fused_attn = False
        block.attn.attn_drop.register_forward_hook(lambda m, i, o: probs.append(o))
    want = torch.autograd.grad(twin(x)[:, 1].sum(), probs)
    with vx.capture(model, grads=True) as outer:
        with vx.capture(model, grads=True) as inner:
            out = model(x)
            inner.backward(out[:, 1], retain_graph=True)
        outer.backward(out[:, 1])
    for rec in (outer, inner):
        assert len(rec.records) == 2
        for record, expected in zip(rec.records, want):
            torch.testing.assert_close(record.grad_probs(), expected, atol=1e-6, rtol=1e-5)


def test_misused_record_and_backward_arguments_are_clear_errors():
    """These raised raw IndexError / TypeError / RuntimeError / AttributeError from inside vitexplain."""
    from vitexplain.errors import InputError, UsageError

    torch.manual_seed(0)
    model = VisionTransformer(**TINY).eval()
    with vx.capture(model, grads=True) as rec:
        out = model(torch.randn(2, 3, 32, 32))
    record = rec.records[0]  # 17 queries
    for bad in (torch.tensor([17]), torch.tensor([-18]), 1.5, "cls", torch.tensor([0.5]), torch.ones(3, dtype=torch.bool)):
        with pytest.raises(UsageError):
            record.probs(queries=bad)
    rows = torch.tensor([16, -17, 3])  # valid indices still select rows, as plain indexing does
    torch.testing.assert_close(record.probs(queries=rows), record.probs()[..., rows, :])
    keep = torch.zeros(17, dtype=torch.bool)
    keep[[0, 5]] = True
    torch.testing.assert_close(record.probs(queries=keep), record.probs()[..., [0, 5], :])
    for bad in ("score", 3, torch.ones(2, dtype=torch.long)):
        with pytest.raises(InputError):
            rec.backward(bad)
    with pytest.raises(CaptureError, match="not part of an autograd graph"):
        rec.backward(torch.ones(2))
    rec.backward(out[:, 0])
    with pytest.raises(UsageError, match="shape of its output"):
        record.grad_probs(d_out=torch.ones(3, 3))
    with pytest.raises(CaptureError, match="retain_graph=True"):
        rec.backward(out[:, 0])  # the graph was freed by the first backward


class _CachedAttention(nn.Module):
    """One query per call against a KV buffer written in place, as Hugging Face's static caches do:
    ``window`` slots used as a ring (sliding window), or ``None``: slots filled in order, the empty
    ones masked out (a static cache). Keeps the probabilities of each call, computed by hand."""

    def __init__(self, slots: int, window: int | None) -> None:
        super().__init__()
        self.window, self.calls = window, 0
        self.register_buffer("keys", torch.zeros(1, 2, slots, 4))
        self.register_buffer("values", torch.zeros(1, 2, slots, 4))
        self.seen: list = []

    def forward(self, q, k, v):  # (1, 2, 1, 4) each
        slot = self.calls % self.keys.shape[2]
        self.keys[:, :, slot] = k[:, :, 0]  # in place: the buffer's version counts up
        self.values[:, :, slot] = v[:, :, 0]
        self.calls += 1
        filled = torch.arange(self.keys.shape[2]) < self.calls
        mask = None if self.window is not None and self.calls >= self.window else filled
        scores = (q @ self.keys.transpose(-2, -1)) / 2.0
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.exp()  # (not a softmax call, which the capture would record too)
        self.seen.append(weights / weights.sum(-1, keepdim=True))
        return F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=None if mask is None else mask[None, None, None])


@pytest.mark.parametrize("window", [None, 3], ids=["static", "sliding"])
def test_keys_overwritten_in_place_after_the_call_are_read_as_the_call_saw_them_or_refused(window):
    """Records keep the keys without copying them. A sliding-window KV cache overwrites, in place, keys
    that earlier calls attended to: their records then recomputed other probabilities, silently (HF's
    Gemma-3 / Mistral with cache_implementation='static' during generate). Without gradients a call whose keys
    had been written in place keeps its probabilities, computed at the call (recording/early.py): every record
    reads as the call saw it (it refused before). A capture taking gradients keeps q and k (the gradient is
    hooked on them): there a record whose attended keys a later call overwrote raises, and a static cache that
    only fills masked slots later stays readable. Oracle: the probabilities computed by hand at each call."""

    def run(grads: bool) -> tuple[list, list]:
        torch.manual_seed(0)
        module = _CachedAttention(slots=3 if window else 6, window=window)
        calls = [tuple(torch.randn(1, 2, 1, 4, requires_grad=grads) for _ in range(3)) for _ in range(6)]
        with torch.set_grad_enabled(grads), vx.capture(module, grads=grads) as rec:
            for q, k, v in calls:
                module(q, k, v)
        return rec.records, module.seen

    records, seen = run(grads=False)
    assert len(records) == 6
    for record, expected in zip(records, seen):
        assert record._k is None  # (the keys are not kept)
        torch.testing.assert_close(record.probs(), expected, atol=1e-6, rtol=0)

    records, seen = run(grads=True)
    # static: later calls fill slots every earlier call masked out; ring: each later call overwrites a slot
    # that every earlier call attended to (calls 0-2 attend slots 0-2 as they fill, call 3 rewrites slot 0)
    readable = range(6) if window is None else [5]
    assert len(records) == 6
    for i, (record, expected) in enumerate(zip(records, seen)):
        if i in readable:
            torch.testing.assert_close(record.probs(), expected, atol=1e-6, rtol=0)
        else:
            with pytest.raises(CaptureError, match="overwritten in place"):
                record.probs()
