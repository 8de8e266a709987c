"""Attention written the many ways people write it, captured while it runs: each record's probabilities against
softmax(q k^T * scale + mask) written out by hand in float64 (SDPA's conventions: a boolean mask marks what takes
part, ``is_causal`` is top-left aligned, ``enable_gqa`` repeats each key head, rows with every key masked are zeros).

Covers the shapes SDPA accepts besides (B, H, N, E): an unbatched (N, E) sequence, (B, N, E) without heads, extra
leading dims, broadcast and expanded q/k; masks of each broadcast shape; and nn.MultiheadAttention's options.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vitexplain as vx

B, H, N, E = 2, 4, 6, 8


def _oracle(q: Tensor, k: Tensor, mask: Optional[Tensor] = None, scale: Optional[float] = None,
            causal: bool = False, gqa: bool = False) -> Tensor:
    """softmax(q k^T * scale + mask) in float64, fully masked rows as zeros; leading dims as SDPA broadcasts them."""
    q, k = q.double(), k.double()
    if gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        scores = scores.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)


class _Attend(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.options = options

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, **self.options)


class _Net(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.attn = _Attend(**options)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.attn(q, k, v)


def _r(*shape: int) -> Tensor:
    return torch.randn(*shape)


# (id, q, k, v, SDPA options, how the oracle's (..., H, N_q, N_k) is laid out as the record's (B', H, N_q, N_k))
_CASES = {
    "unbatched (N, E)": lambda: ((_r(N, E), _r(N, E), _r(N, E)), {}),
    "unbatched (N, E), bool mask": lambda: ((_r(N, E), _r(N, E), _r(N, E)), {"attn_mask": torch.rand(N, N) > 0.3}),
    "unbatched (N_q, E), causal, N_q < N_k": lambda: ((_r(3, E), _r(N, E), _r(N, E)), {"is_causal": True}),
    "unbatched q against batched keys": lambda: ((_r(N, E), _r(B, N, E), _r(B, N, E)), {}),
    "(1, N, E) queries against (B, N, E) keys": lambda: ((_r(1, N, E), _r(B, N, E), _r(B, N, E)), {}),
    "(B, N, E), float mask (B, N, N)": lambda: ((_r(B, N, E), _r(B, N, E), _r(B, N, E)), {"attn_mask": _r(B, N, N)}),
    "causal N_q > N_k": lambda: ((_r(B, H, 7, E), _r(B, H, 3, E), _r(B, H, 3, E)), {"is_causal": True}),
    "gqa 4x, causal N_q < N_k": lambda: ((_r(B, 8, 3, E), _r(B, 2, 7, E), _r(B, 2, 7, E)),
                                        {"enable_gqa": True, "is_causal": True}),
    "5-D windows, mask broadcast over images": lambda: ((_r(B, 3, H, N, E), _r(B, 3, H, N, E), _r(B, 3, H, N, E)),
                                                        {"attn_mask": _r(3, 1, N, N)}),
    "5-D keys shared by the images": lambda: ((_r(B, 3, H, N, E), _r(1, 3, H, N, E), _r(1, 3, H, N, E)), {}),
    "q expanded over the batch, scale given": lambda: ((_r(1, H, N, E).expand(B, H, N, E), _r(B, H, N, E),
                                                        _r(B, H, N, E)), {"scale": 0.37}),
    "float mask with a fully masked row": lambda: ((_r(B, H, N, E), _r(B, H, N, E), _r(B, H, N, E)),
                                                   {"attn_mask": torch.zeros(N, N).index_fill(0, torch.tensor([2]),
                                                                                              float("-inf"))}),
}


@pytest.mark.parametrize("mode", ["fused", "materialize"])
@pytest.mark.parametrize("case", list(_CASES))
def test_sdpa_records_equal_the_hand_written_softmax(case: str, mode: str) -> None:
    """Unbatched (N, E) calls made a record whose probs() raised an IndexError (no head dim to read), and a
    (B, N, E) call whose batch SDPA broadcast (1 query sequence, B key sequences) one that read the batch as heads."""
    torch.manual_seed(0)
    (q, k, v), options = _CASES[case]()
    model = _Net(**options)
    expected_out = F.scaled_dot_product_attention(q, k, v, **options)
    with torch.no_grad(), vx.capture(model, attention_mode=mode) as rec:
        out = model(q, k, v)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)  # the model's output is its own
    assert [r.name for r in rec.records] == ["attn"]
    probs = rec.records[0].probs()
    expected = _oracle(q, k, options.get("attn_mask"), options.get("scale"), options.get("is_causal", False),
                       options.get("enable_gqa", False))
    if expected.dim() < 4:  # no head dim: one head
        expected = expected.unsqueeze(-3)
    expected = expected.reshape(-1, *expected.shape[-3:])  # leading dims folded into the batch
    assert probs.shape == expected.shape
    assert (probs.double() - expected).abs().max().item() < 1e-6  # measured <= 3e-7


def _mha_oracle(mha: nn.MultiheadAttention, query: Tensor, key: Tensor, attn_mask: Optional[Tensor],
                padding: Optional[Tensor]) -> Tensor:
    """(B, H, L, S) softmax of nn.MultiheadAttention from its weights in float64 (batch-first inputs, a bool attn_mask
    (L, S) and key_padding_mask (B, S) where True masks out), fully masked rows as NaN (a plain softmax)."""
    e, h = mha.embed_dim, mha.num_heads
    if mha._qkv_same_embed_dim:
        w_q, w_k = mha.in_proj_weight[:e], mha.in_proj_weight[e:2 * e]
    else:
        w_q, w_k = mha.q_proj_weight, mha.k_proj_weight
    b_q, b_k = mha.in_proj_bias[:e], mha.in_proj_bias[e:2 * e]
    qp = (query.double() @ w_q.double().T + b_q.double()).unflatten(-1, (h, e // h)).transpose(1, 2)
    kp = (key.double() @ w_k.double().T + b_k.double()).unflatten(-1, (h, e // h)).transpose(1, 2)
    scores = qp @ kp.transpose(-1, -2) / math.sqrt(e // h)
    if attn_mask is not None:
        scores = scores.masked_fill(attn_mask, float("-inf"))
    if padding is not None:
        scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    return torch.softmax(scores, -1)


class _MHANet(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.mha = mha

    def forward(self, query: Tensor, key: Tensor, **options) -> Tensor:
        return self.mha(query, key, key, **options)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("cross", [False, True])
def test_multihead_attention_records_equal_the_hand_written_softmax(batch_first: bool, need_weights: bool,
                                                                     cross: bool) -> None:
    """nn.MultiheadAttention with an attn_mask and a key_padding_mask that masks every key of one query row: the
    record is the call's softmax; that row is zeros where MHA runs SDPA (need_weights=False) and NaN, as the weights
    MHA returns, where it runs its own softmax (need_weights=True)."""
    torch.manual_seed(0)
    e, heads, n_q = 16, 4, 5
    n_k = 7 if cross else n_q
    mha = nn.MultiheadAttention(e, heads, batch_first=batch_first, kdim=12 if cross else None,
                                vdim=12 if cross else None).eval()
    query = torch.randn(2, n_q, e)
    key = torch.randn(2, n_k, 12) if cross else query
    attn_mask = torch.zeros(n_q, n_k, dtype=torch.bool)
    attn_mask[1, 2:] = True  # query 1 sees keys 0, 1 only
    padding = torch.zeros(2, n_k, dtype=torch.bool)
    padding[0, :2] = True  # image 0: keys 0, 1 padded, so its query 1 sees no key
    model = _MHANet(mha)
    q_in, k_in = (query, key) if batch_first else (query.transpose(0, 1), key.transpose(0, 1))
    if not cross:
        k_in = q_in
    options = dict(attn_mask=attn_mask, key_padding_mask=padding, need_weights=need_weights,
                   average_attn_weights=False)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # (MHA's C++ fast path gives a fully masked row NaN, docs/guide.md)
    try:
        with torch.no_grad():
            expected_out, weights = model(q_in, k_in, **options)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    with torch.no_grad():
        with vx.capture(model) as rec:
            out, _ = model(q_in, k_in, **options)
    torch.testing.assert_close(out, expected_out, equal_nan=True)
    assert [(r.name, r.kind) for r in rec.records] == [("mha", "cross" if cross else "self")]
    probs = rec.records[0].probs()
    expected = _mha_oracle(mha, query, key, attn_mask, padding)
    assert bool(expected[0, :, 1].isnan().all())  # (the case covers a fully masked row)
    if need_weights:
        torch.testing.assert_close(probs, weights, equal_nan=True)  # what MHA returned, NaN row included
    else:
        expected = torch.nan_to_num(expected, nan=0.0)
    assert probs.shape == expected.shape
    assert torch.equal(probs.isnan(), expected.isnan())
    assert (probs.double() - expected).nan_to_num(0.0).abs().max().item() < 1e-6  # measured <= 2e-7


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_rows_with_every_key_masked_are_zeros() -> None:
    """A document mask whose padding queries see no key (and an ALiBi score_mod reading a captured tensor): the
    record is the hand-written masked softmax, fully masked rows zeros as FlexAttention's own output there."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    n, heads = 16, 2
    doc = torch.tensor([0] * 6 + [1] * 6 + [-1] * 4)  # -1: padding, in no document
    slopes = torch.tensor([0.5, 0.25])
    block_mask = flex.create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (doc[qi] >= 0), None, None, n, n,
                                        device="cpu")

    class Flex(nn.Module):
        def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = flex.flex_attention(q, k, v, block_mask=block_mask,
                                      score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi))
            return out.transpose(1, 2).flatten(2)

    q, k, v = (torch.randn(2, heads, n, E) for _ in range(3))
    model = Flex()
    with torch.no_grad(), vx.capture(model) as rec:
        out = model(q, k, v)
    i = torch.arange(n)
    allowed = (doc[:, None] == doc[None]) & (doc[:, None] >= 0)
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(E) + slopes.double()[:, None, None] * (i[None] - i[:, None])
    expected = torch.nan_to_num(scores.masked_fill(~allowed, float("-inf")).softmax(-1), nan=0.0)
    probs = rec.records[0].probs()
    assert bool((out.unflatten(-1, (heads, E))[:, 12:] == 0).all())  # (FlexAttention's own output there)
    assert bool((probs[..., 12:, :] == 0).all())
    assert (probs.double() - expected).abs().max().item() < 1e-6  # measured 1e-7


class _AttentionPool(nn.Module):
    """OpenAI CLIP's attention pooling: ``F.multi_head_attention_forward`` called directly, the mean token as the one
    query; the head count kept as ``n_head`` (no ``num_heads`` attribute)."""

    def __init__(self, dim: int = 16, n_head: int = 4) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.c_proj = (nn.Linear(dim, dim) for _ in range(4))
        self.n_head = n_head

    def forward(self, x: Tensor, need_weights: bool) -> Tensor:  # x: (N, B, C)
        x = torch.cat([x.mean(0, keepdim=True), x])
        out, _ = F.multi_head_attention_forward(
            x[:1], x, x, x.shape[-1], self.n_head, None, torch.cat([self.q_proj.bias, self.k_proj.bias,
                                                                    self.v_proj.bias]),
            None, None, False, 0.0, self.c_proj.weight, self.c_proj.bias, training=False, need_weights=need_weights,
            use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight, average_attn_weights=False)
        return out[0]


@pytest.mark.parametrize("need_weights", [False, True])
def test_functional_multi_head_attention_forward_is_recorded_with_its_own_head_count(need_weights: bool) -> None:
    """With need_weights=True MHA's softmax is (B * heads, N_q, N_k): the heads were read from the module's
    ``num_heads`` only, so a module naming it otherwise left no record (NoAttentionError, or a layer missing)."""
    torch.manual_seed(0)
    model = _AttentionPool().eval()
    x = torch.randn(9, 2, 16)
    with torch.no_grad(), vx.capture(model) as rec:
        model(x, need_weights)
    tokens = torch.cat([x.mean(0, keepdim=True), x]).double()  # (10, B, C)
    q = (tokens[:1] @ model.q_proj.weight.double().T + model.q_proj.bias.double()).view(1, 2, 4, 4).permute(1, 2, 0, 3)
    k = (tokens @ model.k_proj.weight.double().T + model.k_proj.bias.double()).view(10, 2, 4, 4).permute(1, 2, 0, 3)
    expected = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1)  # (B, H, 1, 10)
    assert [r.name for r in rec.records] == [""]
    probs = rec.records[0].probs()
    assert probs.shape == expected.shape
    assert (probs.double() - expected).abs().max().item() < 1e-6  # measured 2e-8


class _Checkpointed(nn.Module):
    """Two attention blocks (SDPA, then nn.MultiheadAttention) run under non-reentrant torch.utils.checkpoint."""

    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.checkpointing = checkpointing

    def block(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 8)
        return self.mha(y, y, y, need_weights=False)[0]

    def forward(self, x: Tensor) -> Tensor:
        if self.checkpointing:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.block, x, use_reentrant=False)
        return self.block(x)


@pytest.mark.parametrize("mode,grads", [("materialize", True), ("materialize", False), ("auto", False)])
def test_materializing_capture_of_a_non_reentrant_checkpoint_keeps_the_backward_working(mode: str, grads: bool) -> None:
    """torch.utils.checkpoint(use_reentrant=False) recomputes the block in the backward pass, outside the capture's
    view, as SDPA itself; a call the capture had computed eagerly saved other tensors, and the user's own
    loss.backward() raised torch's CheckpointError. Oracle: the same model without checkpointing."""
    torch.manual_seed(0)
    model = _Checkpointed(checkpointing=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    runs = []
    for checkpointing in (False, True):
        model.checkpointing = checkpointing
        x.grad = None
        with vx.capture(model, grads=grads, attention_mode=mode) as rec:
            model(x).square().sum().backward()
        runs.append((rec, x.grad.clone()))
    (plain, plain_grad), (checkpointed, checkpointed_grad) = runs
    torch.testing.assert_close(checkpointed_grad, plain_grad)
    assert [r.name for r in checkpointed.records] == [r.name for r in plain.records] == ["", "mha"]
    for got, want in zip(checkpointed.records, plain.records):
        torch.testing.assert_close(got.probs(), want.probs(), atol=1e-6, rtol=0)
        if grads:
            torch.testing.assert_close(got.grad_probs(), want.grad_probs(), atol=1e-5, rtol=1e-5)


def test_a_reentrant_checkpoint_with_grads_is_refused_naming_checkpointing() -> None:
    """torch.utils.checkpoint(use_reentrant=True) runs the block's forward without a graph, so dy/dA of its attention
    cannot be had; the refusal said only 'no_grad, or nothing requires grad', which was not the user's case."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = _Checkpointed(checkpointing=False)
    x = torch.randn(2, 5, 8, requires_grad=True)
    with vx.capture(model, grads=True) as rec:
        checkpoint(model.block, x, use_reentrant=True).square().sum().backward()
    with pytest.raises(vx.CaptureError, match=r"use_reentrant=True.*use_reentrant=False"):
        rec.records[0].grad_probs()
