"""Attention of every kind vitexplain promises, written as users write it in their own models, captured while it runs.

Kinds: FlexAttention (score_mods: relative bias, ALiBi, soft-capping; block masks: causal, sliding window, documents),
``nn.MultiheadAttention``, ``F.scaled_dot_product_attention``, and the classic kinds written as custom modules
declared by extractors (additive, multiplicative, local windowed, strided). Oracles are written here in float64 from
each module's parameters (no vitexplain code): ``softmax`` of the scores with the same bias and mask. Each case also
checks that the model's outputs are those of the uncaptured model and that the model is left as found.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import vitexplain as vx
from vitexplain.recording import AttentionWeights, register_attention, unregister_attention

flex = pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.usefixtures("one_thread")]


def softmax64(scores: Tensor, allowed: Tensor | None = None) -> Tensor:
    """softmax over the last dim in float64, entries where ``allowed`` is False masked out, fully masked rows 0."""
    scores = scores.double()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.nan_to_num(scores.softmax(-1), nan=0.0)


def qk64(q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
    """q k^T * scale in float64 (scale 1 / sqrt(E) by default)."""
    return q.double() @ k.double().transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)


# -- FlexAttention: what a score_mod reads through the module -------------------------------------------------------


class _StepDecoder(nn.Module):
    """Decodes one query per call over fixed keys; the score_mod hides the keys after the position ``self.pos``, a
    Python int the module advances after each call: read through ``self`` when the score_mod runs, or (``local``)
    copied into a local variable at the call, which the score_mod captures."""

    def __init__(self, local: bool) -> None:
        super().__init__()
        self.pos, self.local = 0, local

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.local:
            pos = self.pos
            out = flex.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.where(ki <= pos, s, -math.inf))
        else:
            out = flex.flex_attention(q, k, v,
                                      score_mod=lambda s, b, h, qi, ki: torch.where(ki <= self.pos, s, -math.inf))
        self.pos += 1
        return out


class _RelBias(nn.Module):
    """A learned relative-position bias read by the score_mod as ``self.bias`` (a bound method as the score_mod)."""

    def __init__(self, heads: int = 2, n: int = 8) -> None:
        super().__init__()
        self.n = n
        self.bias = nn.Parameter(torch.randn(heads, 2 * n - 1))

    def rel(self, s: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return s + self.bias[h, qi - ki + self.n - 1]

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return flex.flex_attention(q, k, v, score_mod=self.rel)


def test_flex_records_whose_score_mod_reads_module_attributes_changed_since_are_refused():
    """A score_mod that reads ``self.pos`` (a Python int advanced at every decoding step) or ``self.bias`` (a
    Parameter an optimizer steps) was recomputed with the values of the time the record was read: every step's
    record silently had the last step's mask (errors 0.5-1 in probability), and a stepped bias gave other
    probabilities. Records whose reads did not change stay readable; the changed ones are refused."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 8, 4)
    for local in (False, True):
        decoder = _StepDecoder(local)
        with torch.no_grad(), vx.capture(decoder) as rec:
            for _ in range(3):
                decoder(q, k, k)
        for step, record in enumerate(rec.records):
            if local:  # (the remedy the error names: the position copied at the call)
                want = softmax64(qk64(q, k), torch.arange(8) <= step)
                torch.testing.assert_close(record.probs().double(), want, atol=1e-6, rtol=0)
            else:  # (self.pos moved on inside the forward, right after the call)
                with pytest.raises(vx.CaptureError, match=r"_StepDecoder\.pos.*changed after the call"):
                    record.probs()

    model = _RelBias()
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    i = torch.arange(8)
    want = softmax64(qk64(q, k) + model.bias.detach().double()[:, i[:, None] - i[None] + 7])
    with torch.no_grad(), vx.capture(model) as rec:
        model(q, k, k)
    torch.testing.assert_close(rec.records[0].probs().double(), want, atol=1e-6, rtol=0)  # (read as the call saw it)
    model.bias = nn.Parameter(model.bias.detach().clone())  # a new tensor of the same values: still the call's
    torch.testing.assert_close(rec.records[0].probs().double(), want, atol=1e-6, rtol=0)
    with torch.no_grad():
        model.bias.add_(torch.randn(2, 15))  # e.g. an optimizer step before the records are read
    with pytest.raises(vx.CaptureError, match=r"_RelBias\.bias.*changed after the call"):
        rec.records[0].probs()
    model.bias = nn.Parameter(torch.randn(2, 15))  # another tensor under the same name
    with pytest.raises(vx.CaptureError, match=r"_RelBias\.bias.*changed after the call"):
        rec.records[0].probs()


# -- a small ViT whose attention is of each kind: records and rollout against the oracle ---------------------------

N_TOK = 17  # class token + 4 x 4 patches of a 32 x 32 image


class _Kind(nn.Module):
    """timm's ``attn_layer`` interface; ``oracle(x)`` is the layer's (B, H, N, N) attention in float64, from its
    parameters."""

    def __init__(self, dim: int, num_heads: int = 2, **_: object) -> None:
        super().__init__()
        self.dim, self.heads = dim, num_heads

    def project(self, x: Tensor, weight: Tensor, bias: Tensor | None, double: bool = False) -> Tensor:
        """(B, N, D) -> (B, H, N, D / H)."""
        if double:
            x, weight, bias = x.double(), weight.double(), None if bias is None else bias.double()
        y = x @ weight.T + (0 if bias is None else bias)
        return y.unflatten(-1, (self.heads, -1)).transpose(1, 2)


class _MHA(_Kind):
    """nn.MultiheadAttention inside the block; sequence-first unless ``batch_first``, weights asked or not."""

    batch_first, need_weights = True, False

    def __init__(self, dim: int, num_heads: int = 2, **_: object) -> None:
        super().__init__(dim, num_heads)
        self.mha = nn.MultiheadAttention(dim, num_heads, batch_first=self.batch_first)

    def forward(self, x: Tensor, attn_mask=None, is_causal: bool = False) -> Tensor:
        y = x if self.batch_first else x.transpose(0, 1)
        out = self.mha(y, y, y, need_weights=self.need_weights, average_attn_weights=False)[0]
        return out if self.batch_first else out.transpose(0, 1)

    def oracle(self, x: Tensor) -> Tensor:
        w_q, w_k, _ = self.mha.in_proj_weight.detach().chunk(3)
        b_q, b_k, _ = self.mha.in_proj_bias.detach().chunk(3)
        q, k = self.project(x, w_q, b_q, True), self.project(x, w_k, b_k, True)
        return softmax64(qk64(q, k))


class _MHASeqFirstWeights(_MHA):
    batch_first, need_weights = False, True


class _QKV(_Kind):
    def __init__(self, dim: int, num_heads: int = 2, **_: object) -> None:
        super().__init__(dim, num_heads)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def qkv_heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (B, H, N, D / H): strided views of one projection (not contiguous)."""
        return self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)

    def qk64(self, x: Tensor) -> Tensor:
        w, b = self.qkv.weight.detach(), self.qkv.bias.detach()
        d = self.dim
        return qk64(self.project(x, w[:d], b[:d], True), self.project(x, w[d:2 * d], b[d:2 * d], True))

    def out(self, o: Tensor) -> Tensor:
        return self.proj(o.transpose(1, 2).flatten(2))


class _SDPABias(_QKV):
    """SDPA with a learned (H, N, N) float bias as its attn_mask, on non-contiguous q, k, v."""

    def __init__(self, dim: int, num_heads: int = 2, **_: object) -> None:
        super().__init__(dim, num_heads)
        self.bias = nn.Parameter(torch.randn(num_heads, N_TOK, N_TOK))

    def forward(self, x: Tensor, attn_mask=None, is_causal: bool = False) -> Tensor:
        q, k, v = self.qkv_heads(x)
        return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias))

    def oracle(self, x: Tensor) -> Tensor:
        return softmax64(self.qk64(x) + self.bias.detach().double())


SLOPES = (0.5, 0.25)  # ALiBi slopes of the two heads
CAP, WINDOW = 5.0, 6


def _alibi_capped(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
    """ALiBi (symmetric distance penalty) then tanh soft-capping."""
    slopes = torch.tensor(SLOPES)
    return CAP * torch.tanh((s - slopes[h] * (qi - ki).abs()) / CAP)


class _Flex(_QKV):
    """FlexAttention: ALiBi + soft-capping score_mod, sliding-window block mask (|i - j| <= WINDOW)."""

    flex_fn = staticmethod(flex.flex_attention)

    def forward(self, x: Tensor, attn_mask=None, is_causal: bool = False) -> Tensor:
        q, k, v = self.qkv_heads(x)
        n = x.shape[1]
        mask = flex.create_block_mask(lambda b, h, qi, ki: (qi - ki).abs() <= WINDOW, None, None, n, n, device="cpu")
        return self.out(self.flex_fn(q, k, v, score_mod=_alibi_capped, block_mask=mask))

    def oracle(self, x: Tensor) -> Tensor:
        i = torch.arange(x.shape[1])
        distance = (i[:, None] - i[None]).abs()
        scores = self.qk64(x) - torch.tensor(SLOPES, dtype=torch.float64)[:, None, None] * distance
        return softmax64(CAP * torch.tanh(scores / CAP), distance <= WINDOW)


class _Additive(_Kind):
    """Multi-head additive (Bahdanau) self-attention ``e_ij = v_h . tanh(W q_i + U k_j)``; keeps ``self.alpha``."""

    def __init__(self, dim: int, num_heads: int = 2, **_: object) -> None:
        super().__init__(dim, num_heads)
        self.w, self.u = nn.Linear(dim, 8 * num_heads), nn.Linear(dim, 8 * num_heads, bias=False)
        self.v = nn.Parameter(torch.randn(num_heads, 8))
        self.value = nn.Linear(dim, dim)

    def forward(self, x: Tensor, attn_mask=None, is_causal: bool = False) -> Tensor:
        wq, uk = self.project(x, self.w.weight, self.w.bias), self.project(x, self.u.weight, None)
        e = (torch.tanh(wq[:, :, :, None] + uk[:, :, None]) * self.v[None, :, None, None]).sum(-1)
        self.alpha = e.softmax(-1)
        return (self.alpha @ self.project(x, self.value.weight, self.value.bias)).transpose(1, 2).flatten(2)

    def oracle(self, x: Tensor) -> Tensor:
        wq = self.project(x, self.w.weight.detach(), self.w.bias.detach(), True)
        uk = self.project(x, self.u.weight.detach(), None, True)
        return softmax64((torch.tanh(wq[:, :, :, None] + uk[:, :, None]) * self.v.detach().double()[None, :, None, None])
                         .sum(-1))


def _strided(n: int) -> Tensor:
    """Sparse (strided) pattern: i attends to j with the same index mod 3, and to its neighbours."""
    i = torch.arange(n)
    return (i[:, None] % 3 == i[None] % 3) | ((i[:, None] - i[None]).abs() <= 1)


class _Strided(_QKV):
    """Strided sparse attention written as a dense masked softmax; returns nothing but keeps ``self.weights``."""

    def forward(self, x: Tensor, attn_mask=None, is_causal: bool = False) -> Tensor:
        q, k, v = self.qkv_heads(x)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        self.weights = scores.masked_fill(~_strided(x.shape[1]), float("-inf")).softmax(-1)
        return self.out(self.weights @ v)

    def oracle(self, x: Tensor) -> Tensor:
        return softmax64(self.qk64(x), _strided(x.shape[1]))


class _Local(_QKV):
    """Local windowed attention computed on the (2w + 1) neighbours only, (B, H, N, 2w + 1) weights."""

    w = 2

    def forward(self, x: Tensor, attn_mask=None, is_causal: bool = False) -> Tensor:
        q, k, v = self.qkv_heads(x)
        n, w = x.shape[1], self.w
        keys = torch.nn.functional.pad(k, (0, 0, w, w)).unfold(2, 2 * w + 1, 1)  # (B, H, N, hd, 2w+1)
        values = torch.nn.functional.pad(v, (0, 0, w, w)).unfold(2, 2 * w + 1, 1)
        scores = torch.einsum("bhnd,bhndw->bhnw", q, keys) * q.shape[-1] ** -0.5
        pos = torch.arange(n)[:, None] + torch.arange(-w, w + 1)[None]
        self.local = scores.masked_fill((pos < 0) | (pos >= n), float("-inf")).softmax(-1)
        return self.out(torch.einsum("bhnw,bhndw->bhnd", self.local, values))

    def oracle(self, x: Tensor) -> Tensor:
        i = torch.arange(x.shape[1])
        return softmax64(self.qk64(x), (i[:, None] - i[None]).abs() <= self.w)


def _local_dense(module: _Local, inputs, output) -> Tensor:
    """Extractor: the local weights scattered into (B, H, N, N)."""
    local, w = module.local, module.w
    b, h, n, width = local.shape
    index = (torch.arange(n)[:, None] + torch.arange(width)[None]).expand(b, h, n, width)
    return local.new_zeros(b, h, n, n + 2 * w).scatter(-1, index, local)[..., w:w + n]


KINDS = {
    "mha batch_first": _MHA,
    "mha sequence-first, need_weights": _MHASeqFirstWeights,
    "sdpa learned bias, strided q/k/v": _SDPABias,
    "flex alibi + softcap, sliding window": _Flex,
    "additive (declared)": _Additive,
    "strided sparse (declared)": _Strided,
    "local window (declared)": _Local,
}
EXTRACTORS = {_Additive: lambda m, i, o: AttentionWeights(m.alpha, "self"),
              _Strided: lambda m, i, o: m.weights, _Local: _local_dense}


def _vit(layer: type) -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                              attn_layer=layer).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)
    return model


def _rollout64(attention: list[Tensor]) -> Tensor:
    """docs/methods.md: the class row of prod rownorm(0.5 mean_h A + 0.5 I), patches as the 4 x 4 grid."""
    b = attention[0].shape[0]
    row = torch.zeros(b, 1, N_TOK, dtype=torch.float64)
    row[:, 0, 0] = 1.0
    for a in reversed(attention):
        hat = 0.5 * a.mean(1) + 0.5 * torch.eye(N_TOK, dtype=torch.float64)
        row = row @ (hat / hat.sum(-1, keepdim=True))
    return row[:, 0, 1:].reshape(b, 4, 4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_vit_of_each_attention_kind_records_the_oracle_and_its_rollout(kind):
    """Each kind in the blocks of a timm ViT: one record per block equal to the float64 oracle from the block's
    inputs, the outputs those of the uncaptured model, rollout (the plan lists it) equal to the oracle's rollout, and
    the model as found. (MHA's C++ fast path runs outside the capture, inside it MHA's Python path: float rounding.)"""
    layer = KINDS[kind]
    extractor = EXTRACTORS.get(layer)
    if extractor is not None:
        register_attention(layer, extractor)
    try:
        model = _vit(layer)
        x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        inputs: list[Tensor] = []
        handles = [b.attn.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach())) for b in model.blocks]
        with torch.no_grad():
            plain = model(x)
        for handle in handles:
            handle.remove()
        oracle = [block.attn.oracle(t) for block, t in zip(model.blocks, inputs)]
        fast = torch.backends.mha.get_fastpath_enabled()
        with torch.no_grad(), vx.capture(model) as rec:
            captured = model(x)
        if layer is _MHA:  # (its fast path ran outside the capture: logits differ by 1.4e-6 measured)
            torch.testing.assert_close(captured, plain, atol=1e-5, rtol=0)
        else:
            assert torch.equal(captured, plain)
        assert len(rec.records) == 2 and all(r.kind == "self" for r in rec.records)
        for record, want in zip(rec.records, oracle):
            assert record.probs().shape == want.shape
            assert (record.probs().double() - want).abs().max().item() < 1e-6  # measured <= 6e-8
        ex = vx.Explainer(model)
        assert "rollout" in ex.methods()
        maps = ex.explain(x, method="rollout").maps
        want = _rollout64(oracle)
        assert (maps.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()  # measured 2e-7 relative
        assert torch.backends.mha.get_fastpath_enabled() is fast
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        assert all(p.grad is None for p in model.parameters()) and not model.training
    finally:
        if extractor is not None:
            unregister_attention(layer)


# -- gradient methods and LRP on FlexAttention models on the CPU -----------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager_flex", "compiled_flex"])
def test_lrp_and_gradient_methods_on_a_flex_vit_on_cpu_are_refused_and_leave_it_working(compiled):
    """attnlrp / cp_lrp on a model calling FlexAttention raised torch's bare NotImplementedError ('FlexAttention does
    not support backward on CPU') instead of saying that LRP does not cover FlexAttention. With
    ``torch.compile(flex_attention)`` in the module, a gradient method raised that error too, and afterwards every
    capture of the model failed, rollout included ('bool' object has no attribute 'type': dynamo had compiled the
    capture's torch function mode as a frame of its own when the compiled call fell back to eager)."""
    if compiled:
        class Layer(_Flex):
            flex_fn = staticmethod(torch.compile(flex.flex_attention, backend="eager"))
    else:
        Layer = _Flex
    model = _vit(Layer)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    ex = vx.Explainer(model)
    first = ex.explain(x, method="rollout").maps
    for method in ("attnlrp", ["rollout", "cp_lrp"]):
        with pytest.raises(vx.UnsupportedModelError, match="calls FlexAttention, which the LRP rules do not cover"):
            ex.explain(x, method=method, target=1)
    with pytest.raises(vx.CaptureError, match="no backward pass on CPU"):
        ex.explain(x, method="grad_rollout", target=1)
    torch.testing.assert_close(ex.explain(x, method="rollout").maps, first, atol=0, rtol=0)  # still works
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    if compiled:  # dynamo gave up compiling flex_attention's code (its CPU backward check): later tests compile it anew
        torch._dynamo.reset()


# -- extractors whose weights the methods cannot use: clear errors ----------------------------------------------------


@pytest.mark.parametrize("returned", ["detached", "recomputed", "view"])
def test_gradient_methods_on_extractor_weights_outside_the_graph_say_so(returned):
    """An extractor returning a detached copy, a recomputation or a view made in the extractor (``.view``,
    ``.unsqueeze``): the Explainer's gradient methods said 'nothing captured is part of an autograd graph (the forward
    ran under torch.no_grad(), or neither the input nor any parameter requires grad)', neither of which was the case.
    The module's own weights tensor gives the map."""
    extractors = {"detached": lambda m, i, o: m.weights.detach(), "recomputed": lambda m, i, o: m.weights * 1.0,
                  "view": lambda m, i, o: m.weights.view(m.weights.shape)}
    model = _vit(_Strided)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    register_attention(_Strided, extractors[returned])
    try:
        with pytest.raises(vx.CaptureError, match=r"not the tensor the module's output was computed from"):
            vx.Explainer(model).explain(x, method="generic", target=1)
        register_attention(_Strided, lambda m, i, o: m.weights)
        maps = vx.Explainer(model).explain(x, method="generic", target=1).maps
    finally:
        unregister_attention(_Strided)
    assert maps.shape == (2, 4, 4) and bool(torch.isfinite(maps).all()) and float(maps.abs().max()) > 0


def test_extractor_weights_with_heads_folded_into_the_batch_are_refused_by_the_attention_methods():
    """(B * heads, N, N) weights read as B * heads images of one head: rollout and raw raised torch's shape errors
    ('The size of tensor a (2) must match the size of tensor b (4)'); they now say what the extractor must return."""
    model = _vit(_Strided)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    register_attention(_Strided, lambda m, i, o: m.weights.flatten(0, 1))
    try:
        for method in ("rollout", "raw"):
            with pytest.raises(vx.UnsupportedModelError, match=r"holds 4 sequences for 2 images.*\(B, H, N_q, N_k\)"):
                vx.Explainer(model).explain(x, method=method)
    finally:
        unregister_attention(_Strided)


def test_flex_calls_under_a_users_torch_function_mode_inside_the_capture_are_recorded_or_refused():
    """A torch function mode the user enters inside the capture (a FLOP counter, a device context) passes each call
    down to the capture's: FlexAttention's own frame was then hidden behind the user's ``__torch_function__``, and
    with inputs requiring grad on the CPU torch's bare NotImplementedError came instead of the capture's refusal."""
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = _RelBias()

        def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return self.attn(q, k, v)

    torch.manual_seed(0)
    model = Net()
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    i = torch.arange(8)
    want = softmax64(qk64(q, k) + model.attn.bias.detach().double()[:, i[:, None] - i[None] + 7])
    with torch.no_grad(), vx.capture(model) as rec, Counting():
        model(q, k, k)
    assert Counting.calls > 0 and [(r.name, r.source) for r in rec.records] == [("attn", "flex")]
    torch.testing.assert_close(rec.records[0].probs().double(), want, atol=1e-6, rtol=0)
    with pytest.raises(vx.CaptureError, match="no backward pass on CPU"):
        with vx.capture(model, grads=True), Counting():
            model(q.requires_grad_(), k, k)
