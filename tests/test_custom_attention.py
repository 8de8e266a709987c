"""Attention declared by extractors: additive (Bahdanau), multiplicative (Luong), local windows, per-step decoders.

Oracles: the weights are recomputed in the tests from each module's parameters with plain
formulas (not the modules' code), gradients come from ``retain_grad`` on the modules' own
weights in a separate run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitexplain as vx
from vitexplain.errors import CaptureError
from vitexplain.recording import AttentionWeights, from_attribute, from_output


class Additive(nn.Module):
    """Bahdanau attention: ``e_i = v . tanh(W q + U k_i)``, ``alpha = softmax(e)``; returns (context, alpha)."""

    def __init__(self, q_dim: int, k_dim: int, hidden: int) -> None:
        super().__init__()
        self.W = nn.Linear(q_dim, hidden, bias=False)
        self.U = nn.Linear(k_dim, hidden)
        self.v = nn.Linear(hidden, 1, bias=False)

    def forward(self, query: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.v(torch.tanh(self.W(query)[:, None] + self.U(keys))).squeeze(-1)  # (B, N)
        alpha = torch.softmax(e, dim=-1)
        return (alpha[..., None] * keys).sum(1), alpha


class Luong(nn.Module):
    """Luong "general" attention: ``score(q, k) = q^T W k`` over all queries at once; keeps ``self.weights``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.W = nn.Linear(dim, dim, bias=False)
        self.weights: torch.Tensor | None = None

    def forward(self, queries: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        self.weights = torch.softmax(queries @ self.W(memory).transpose(1, 2), dim=-1)  # (B, N_q, N_k)
        return self.weights @ memory


class LocalWindow(nn.Module):
    """Multi-head self-attention inside a window of +-w tokens, computed on the (2w + 1) neighbours only."""

    def __init__(self, dim: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.local: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        w, h = self.window, self.heads
        q, k, v = self.qkv(x).view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)  # (B, H, N, hd)
        pad_k = F.pad(k, (0, 0, w, w)).unfold(2, 2 * w + 1, 1)  # (B, H, N, hd, 2w+1)
        pad_v = F.pad(v, (0, 0, w, w)).unfold(2, 2 * w + 1, 1)
        scores = torch.einsum("bhnd,bhndw->bhnw", q, pad_k) / (d // h) ** 0.5
        pos = torch.arange(n)[:, None] + torch.arange(-w, w + 1)[None]
        scores = scores.masked_fill(((pos < 0) | (pos >= n))[None, None], float("-inf"))
        self.local = scores.softmax(-1)  # (B, H, N, 2w+1), a 4-D softmax the capture would also see
        out = torch.einsum("bhnw,bhndw->bhnd", self.local, pad_v)
        return out.transpose(1, 2).reshape(b, n, d)


def local_to_dense(module: LocalWindow, inputs, output) -> AttentionWeights:
    """Extractor: scatter the (2w + 1)-wide local weights into (B, H, N, N)."""
    local = module.local
    b, h, n, width = local.shape
    w = module.window
    dense = local.new_zeros(b, h, n, n + 2 * w)
    index = (torch.arange(n)[:, None] + torch.arange(width)[None]).expand(b, h, n, width)
    dense = dense.scatter(-1, index, local)[..., w : w + n]
    return AttentionWeights(dense, "self")


class Seq2Seq(nn.Module):
    """An encoder (linear) and an LSTM decoder that attends (additively) once per step."""

    def __init__(self, vocab: int = 7, dim: int = 12) -> None:
        super().__init__()
        self.encoder = nn.Linear(5, dim)
        self.embed = nn.Embedding(vocab, dim)
        self.cell = nn.LSTMCell(2 * dim, dim)
        self.attention = Additive(dim, dim, 8)
        self.out = nn.Linear(dim, vocab)

    def forward(self, src: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        keys = self.encoder(src)  # (B, N, D)
        h = c = keys.new_zeros(src.shape[0], keys.shape[-1])
        logits = []
        for t in range(tokens.shape[1]):
            context, _ = self.attention(h, keys)
            h, c = self.cell(torch.cat([self.embed(tokens[:, t]), context], -1), (h, c))
            logits.append(self.out(h))
        return torch.stack(logits, 1)


def additive_oracle(m: Additive, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """softmax_i(v . tanh(W q + U k_i)) from the parameters; query (B, Dq), keys (B, N, Dk) -> (B, N)."""
    hidden = torch.tanh((query @ m.W.weight.T)[:, None] + keys @ m.U.weight.T + m.U.bias)
    return torch.softmax(hidden @ m.v.weight[0], dim=-1)


def test_additive_weights_match_hand_formula_and_grads_match_retain_grad():
    m = Additive(6, 4, 5)
    q, k = torch.randn(3, 6), torch.randn(3, 9, 4)
    with vx.capture(m, attention={"": from_output(1, "cross")}, grads=True) as rec:
        context, alpha = m(q, k)
        score = (context * torch.arange(4.0)).sum()
    rec.backward(score)
    (record,) = rec.records
    assert (record.name, record.kind, record.source, record.step) == ("", "cross", "module", 0)
    assert (record.batch_size, record.num_heads, record.num_queries, record.num_keys) == (3, 1, 1, 9)
    expected = additive_oracle(m, q, k)
    torch.testing.assert_close(record.probs()[:, 0, 0], expected, atol=1e-6, rtol=1e-5)
    # oracle gradient: the module's own weights, retained, in a separate forward
    _, alpha = m(q, k)
    alpha.retain_grad()
    ((alpha[..., None] * k).sum(1) * torch.arange(4.0)).sum().backward()
    torch.testing.assert_close(record.grad_probs()[:, 0, 0], alpha.grad, atol=1e-6, rtol=1e-5)
    assert m.W.weight.grad is not None  # (the oracle's backward); the capture wrote no .grad
    assert not m._forward_hooks


def test_luong_weights_from_attribute_and_registry():
    m = Luong(8)
    q, mem = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    expected = torch.softmax(torch.einsum("bqd,de,bke->bqk", q, m.W.weight, mem), dim=-1)
    vx.recording.register_attention(Luong, from_attribute("weights", "cross"))
    try:
        assert any(n.endswith("Luong") for n in vx.recording.registered_attention())
        with vx.capture(nn.Sequential(m)) as rec:  # found by type, no name given
            m(q, mem)
    finally:
        vx.recording.unregister_attention(Luong)
    (record,) = rec.records
    assert record.name == "0" and record.kind == "cross"
    torch.testing.assert_close(record.probs()[:, 0], expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(record.probs(queries=1)[:, 0, 0], expected[:, 1], atol=1e-6, rtol=1e-5)
    with pytest.raises(CaptureError, match="grads=True"):
        record.grad_probs()
    with vx.capture(nn.Sequential(m)) as rec:  # unregistered: its 3-D softmax is not attention the capture knows
        m(q, mem)
    with pytest.raises(vx.NoAttentionError):
        rec.records


def test_local_window_dense_weights_replace_the_softmax_record():
    torch.manual_seed(0)
    m = LocalWindow(8, heads=2, window=2)
    x = torch.randn(2, 7, 8)
    with vx.capture(m) as plain:
        m(x)
    assert [r.source for r in plain.records] == ["eager"]  # the (B, H, N, 2w+1) softmax, not a dense map
    with vx.capture(m, attention={"": local_to_dense}, grads=True) as rec:
        m(x.requires_grad_(True)).sum()
    (record,) = rec.records
    # oracle: dense band attention written out entry by entry
    q, k, _ = m.qkv(x).view(2, 7, 3, 2, 4).permute(2, 0, 3, 1, 4)
    expected = torch.zeros(2, 2, 7, 7)
    for i in range(7):
        cols = [j for j in range(7) if abs(i - j) <= 2]
        s = torch.stack([(q[:, :, i] * k[:, :, j]).sum(-1) / 2.0 for j in cols], -1)
        expected[:, :, i, cols] = s.softmax(-1)
    probs = record.probs()
    torch.testing.assert_close(probs, expected.detach(), atol=1e-6, rtol=1e-5)
    assert torch.all(probs[..., 0, 3:] == 0)  # outside the window: exactly 0
    # the dense tensor is built by the extractor, not used by the module: no dy/dA from it
    with pytest.raises(CaptureError, match="not the tensor the module's output was computed from"):
        record.grad_probs()


def test_per_step_decoder_records_steps_and_gradients():
    torch.manual_seed(0)
    model = Seq2Seq().eval()
    src, tokens = torch.randn(2, 6, 5), torch.randint(0, 7, (2, 4))
    extractor = {"attention": from_output(1, "cross")}
    with vx.capture(model, attention=extractor, grads=True) as rec:
        logits = model(src, tokens)
    score = logits[:, 2].log_softmax(-1)[:, 3].sum()
    rec.backward(score)
    records = rec.select(prefix="attention")
    assert [r.step for r in records] == [0, 1, 2, 3] and all(r.num_queries == 1 for r in records)
    # oracle: the same forward written out, keeping every step's weights
    keys = model.encoder(src)
    h = c = torch.zeros(2, 12)
    kept, out = [], []
    for t in range(4):
        alpha = additive_oracle(model.attention, h, keys)
        alpha.retain_grad()
        kept.append(alpha)
        h, c = model.cell(torch.cat([model.embed(tokens[:, t]), (alpha[..., None] * keys).sum(1)], -1), (h, c))
        out.append(model.out(h))
    torch.stack(out, 1)[:, 2].log_softmax(-1)[:, 3].sum().backward()
    for t, record in enumerate(records):
        torch.testing.assert_close(record.probs()[:, 0, 0], kept[t].detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(record.grad_probs()[:, 0, 0], kept[t].grad, atol=1e-6, rtol=1e-5)
    assert torch.all(records[3].grad_probs() == 0)  # step 3 comes after the scored word


def test_declared_module_errors_are_clear():
    m = Additive(6, 4, 5)
    with pytest.raises(CaptureError, match="no module named"):
        with vx.capture(m, attention={"decoder.att": from_output(1)}):
            pass
    with pytest.raises(CaptureError, match="AttentionWeights"):  # the whole (context, alpha) output
        with vx.capture(m, attention={"": lambda mod, i, o: o}):
            m(torch.randn(1, 6), torch.randn(1, 3, 4))
    with pytest.raises(CaptureError, match="AttentionWeights"):
        with vx.capture(m, attention={"": lambda mod, i, o: {"alpha": o[1]}}):
            m(torch.randn(1, 6), torch.randn(1, 3, 4))
    with pytest.raises(CaptureError, match="kind"):
        with vx.capture(m, attention={"": lambda mod, i, o: AttentionWeights(o[1], "encoder")}):
            m(torch.randn(1, 6), torch.randn(1, 3, 4))
    assert not m._forward_hooks  # removed after the errors too


def test_extractors_may_return_the_weights_tensor_alone():
    """(B, N_k), (B, N_q, N_k) and (B, H, N_q, N_k) plain tensors; the kind follows the module call."""
    torch.manual_seed(0)
    additive = Additive(6, 4, 5)
    q, k = torch.randn(3, 6), torch.randn(3, 9, 4)
    with vx.capture(additive, attention={"": lambda mod, i, o: o[1]}, grads=True) as rec:
        context, _ = additive(q, k)
    rec.backward((context * torch.arange(4.0)).sum())
    (record,) = rec.records
    assert (record.kind, record.source, tuple(record.probs().shape)) == ("self", "module", (3, 1, 1, 9))
    torch.testing.assert_close(record.probs()[:, 0, 0], additive_oracle(additive, q, k), atol=1e-6, rtol=1e-5)
    _, alpha = additive(q, k)  # oracle gradient: the module's own weights, retained
    alpha.retain_grad()
    ((alpha[..., None] * k).sum(1) * torch.arange(4.0)).sum().backward()
    torch.testing.assert_close(record.grad_probs()[:, 0, 0], alpha.grad, atol=1e-6, rtol=1e-5)

    additive.is_cross_attention = True  # the module says what it is, as for SDPA calls
    with vx.capture(additive, attention={"": lambda mod, i, o: o[1]}) as rec:
        additive(q, k)
    assert rec.records[0].kind == "cross"

    luong = Luong(8)
    queries, memory = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    with vx.capture(luong, attention={"": lambda mod, i, o: mod.weights}) as rec:
        luong(queries, memory=memory)
    expected = torch.softmax(torch.einsum("bqd,de,bke->bqk", queries, luong.W.weight, memory), dim=-1)
    (record,) = rec.records
    assert record.kind == "cross"  # a tensor argument named `memory`
    torch.testing.assert_close(record.probs()[:, 0], expected, atol=1e-6, rtol=1e-5)
    with vx.capture(luong, attention={"": lambda mod, i, o: mod.weights}) as rec:
        luong(queries, memory)  # positional: bound to the forward's parameter names
    assert rec.records[0].kind == "cross"

    local = LocalWindow(8, heads=2, window=2)
    x = torch.randn(2, 7, 8)
    with vx.capture(local, attention={"": lambda mod, i, o: local_to_dense(mod, i, o).weights}) as rec:
        local(x)
    (record,) = rec.records
    assert record.kind == "self" and record.probs().shape == (2, 2, 7, 7)
    with vx.capture(local, attention={"": local_to_dense}) as declared:
        local(x)
    torch.testing.assert_close(record.probs(), declared.records[0].probs(), atol=0, rtol=0)


@pytest.mark.parametrize("shape", [(3,), (1, 1, 1, 3, 4)])
def test_a_plain_tensor_of_another_rank_is_a_clear_error(shape):
    m = Additive(6, 4, 5)
    with pytest.raises(CaptureError, match=r"\(B, N_k\), \(B, N_q, N_k\) or \(B, H, N_q, N_k\); got shape"):
        with vx.capture(m, attention={"": lambda mod, i, o: torch.rand(shape)}):
            m(torch.randn(1, 6), torch.randn(1, 3, 4))
    assert not m._forward_hooks


def test_a_registered_module_inside_a_named_module_is_not_recorded_again():
    """A module named in ``attention={...}`` owns the attention inside it, as its SDPA/softmax calls are not
    recorded separately: a registered attention class inside it was recorded too (two records per step)."""
    torch.manual_seed(0)
    model = Seq2Seq()
    src, tokens = torch.randn(2, 4, 5), torch.randint(0, 7, (2, 3))

    def whole(module, inputs, output):  # the named parent reads the weights of its (registered) child
        return AttentionWeights(module.weights, "cross")

    def keep(module, inputs, output):
        model.weights = output[1]

    handle = model.attention.register_forward_hook(keep)
    vx.recording.register_attention(Additive, from_output(1, "cross"))
    try:
        with torch.no_grad(), vx.capture(model, attention={"": whole}) as rec:
            model(src, tokens)
        with torch.no_grad(), vx.capture(model) as registered_only:
            model(src, tokens)
    finally:
        vx.recording.unregister_attention(Additive)
        handle.remove()
    (record,) = rec.records  # one call of the named module: one record, the last step's weights
    assert record.name == "" and record.source == "module"
    assert [r.name for r in registered_only.records] == ["attention"] * 3  # (the registry alone still works)
    torch.testing.assert_close(record.probs()[:, 0, 0], registered_only.records[-1].probs()[:, 0, 0])
