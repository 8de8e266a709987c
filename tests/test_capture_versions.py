"""Records keep the tensors of an attention call by reference: a write into one of them after the call must not
change what the record gives back, silently.

A record recomputes its probabilities (and, with gradients, ``dO V^T``) from the call's q, k, v and mask, or holds
the weights a model (eager softmax, ``nn.MultiheadAttention``) or an extractor returned. Each case here writes one
of those tensors in place after the call and checks that the record either gives the attention of the call, as
computed here from clones taken at call time (float64 oracle, no vitexplain code), or raises a CaptureError that
names the tensor. Writes that change nothing a record reads (no write, a write into an unrelated tensor or into
the attention output, a write before the call) keep every record readable and right.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitexplain as vx

pytestmark = pytest.mark.usefixtures("one_thread")


def oracle(q, k, mask=None, scale=None):
    """softmax(q k^T * scale + mask) in float64 from the given (cloned) tensors; fully masked rows give zeros."""
    q, k = q.detach().double(), k.detach().double()
    s = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.nan_to_num(torch.softmax(s, -1), nan=0.0)


def right_or_refused(read, expected, what: str) -> str:
    """``read()`` equals ``expected`` (float64, 1e-6), or raises a CaptureError naming ``what``; which one."""
    try:
        got = read()
    except vx.CaptureError as error:
        assert what in str(error), str(error)
        assert "in place" in str(error), str(error)
        return "refused"
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=0)
    return "right"


class QKVAttention(nn.Module):
    """A timm-style attention: q, k, v are views of one projection; SDPA with an optional mask; after the call,
    ``after(q, k, v, mask, out)`` runs (the write under test, or none). Keeps clones of the call's tensors."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.after = None
        self.before = None
        self.seen: list[tuple] = []

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        if self.before is not None:
            self.before(q, k, v, mask)
        self.seen.append(tuple(None if t is None else t.detach().clone() for t in (q, k, v, mask)))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if self.after is not None:
            self.after(q, k, v, mask, out)
        self.last = (q, k, v, out)
        return out.transpose(1, 2).reshape(b, n, d)


def _mask(n: int, bool_mask: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if bool_mask:
        m = torch.rand(1, 1, n, n, generator=g) > 0.4
        m[..., 0] = True  # (every row attends somewhere)
        return m
    return torch.randn(1, 1, n, n, generator=g)


WRITES = {
    "q": ("queries", lambda q, k, v, m, o: q.mul_(3.0)),
    "q_view_of_projection": ("queries", lambda q, k, v, m, o: q[:, :, 1:3].add_(1.0)),
    "bool_mask": ("mask", lambda q, k, v, m, o: m.logical_not_()),
    "float_mask": ("mask", lambda q, k, v, m, o: m.mul_(-2.0)),
}


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("case", list(WRITES))
def test_a_query_or_mask_written_after_the_call_is_not_read_silently(case, grad_mode):
    """q (or a view of the projection it lives in) or the mask written in place after the SDPA call: the record
    gave the probabilities of the written tensors, silently. Now it gives the call's, or raises saying which
    tensor was written. Under inference_mode (no version counters) as under no_grad."""
    torch.manual_seed(0)
    what, write = WRITES[case]
    model = QKVAttention().eval()
    model.after = lambda q, k, v, m, o: write(q, k, v, m, o)
    x = torch.randn(2, 5, 8)
    context = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    with context:
        mask = None if what != "mask" else _mask(5, case == "bool_mask")
        with vx.capture(model) as rec:
            model(x, mask)
    q, k, _, m = model.seen[-1]
    expected = oracle(q, k, m)
    record = rec.records[0]
    right_or_refused(record.probs, expected, what)
    right_or_refused(lambda: record.fused_probs("mean"), expected.mean(1), what)


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_a_mask_buffer_updated_between_decoding_steps_is_not_read_silently(grad_mode):
    """A preallocated mask written in place before each decoding step (position ``pos`` opened): every earlier
    step's record used to recompute with the latest mask (attending to keys its call never saw)."""
    torch.manual_seed(0)

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mask = torch.zeros(1, 1, 1, 4, dtype=torch.bool)
            self.seen = []

        def forward(self, q, keys, values, pos):
            self.mask[..., pos] = True
            self.seen.append(self.mask.clone())
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask)

    context = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    calls = []
    with context:
        model = Decoder().eval()
        with vx.capture(model) as rec:
            for pos in range(3):
                q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
                model(q, k, v, pos)
                calls.append((q, k))
    outcomes = [right_or_refused(r.probs, oracle(q, k, m), "mask")
                for r, (q, k), m in zip(rec.records, calls, model.seen)]
    assert outcomes[-1] == "right"  # (the last step's mask was not written since)


def _harmless_after(kind: str):
    if kind == "none":
        return None
    if kind == "output":
        return lambda q, k, v, m, o: o.mul_(2.0)
    if kind == "unrelated":
        other = torch.zeros(3)
        return lambda q, k, v, m, o: other.add_(1.0)
    raise ValueError(kind)


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("after", ["none", "output", "unrelated"])
@pytest.mark.parametrize("before", [False, True], ids=["fresh", "written_before"])
def test_writes_that_change_nothing_a_record_reads_keep_it_readable(after, before, grad_mode):
    """No write, a write into the attention output or into a tensor unrelated to the call, and in-place writes
    made before the call (q scaled in place, a mask built with masked_fill_): records read right, no error."""
    torch.manual_seed(1)
    model = QKVAttention().eval()
    model.after = _harmless_after(after)
    if before:
        model.before = lambda q, k, v, m: (q.mul_(0.5), m.masked_fill_(m < -1.0, float("-inf")))
    x = torch.randn(2, 5, 8)
    context = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    with context:
        mask = _mask(5, False, seed=3)
        with vx.capture(model) as rec:
            model(x, mask)
    q, k, _, m = model.seen[-1]
    torch.testing.assert_close(rec.records[0].probs().double(), oracle(q, k, m), atol=1e-6, rtol=0)


def test_an_eager_softmax_with_a_nan_row_under_inference_mode_stays_readable():
    """An eager softmax over a row with every key masked by -inf gives NaN there; under inference_mode its record
    is told by its sums, NaN where the row is: NaN then and NaN now is no write (NaN != NaN would refuse it)."""

    class Eager(nn.Module):
        def forward(self, q, k, mask):
            return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf")), -1)

    torch.manual_seed(12)
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    mask[..., 1, :] = False
    with torch.inference_mode():
        model = Eager().eval()
        q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 4, 4)
        with vx.capture(model) as rec:
            out = model(q, k, mask)
    assert rec.records[0].source == "eager" and bool(out.isnan().any())
    torch.testing.assert_close(rec.records[0].probs(), out.float(), equal_nan=True)


def test_a_write_into_another_view_of_the_projection_after_a_write_before_keeps_q_readable():
    """q written in place before the call (so its version counter is no longer 0) and v, another view of the same
    projection output (one counter for all views), written after: q's values did not change, its record reads."""
    torch.manual_seed(2)
    model = QKVAttention().eval()
    model.before = lambda q, k, v, m: q.mul_(0.5)
    model.after = lambda q, k, v, m, o: v.add_(1.0)
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), vx.capture(model) as rec:
        model(x)
    q, k, _, _ = model.seen[-1]
    torch.testing.assert_close(rec.records[0].probs().double(), oracle(q, k), atol=1e-6, rtol=0)


def test_fresh_keys_written_after_the_call_are_refused_without_blaming_a_kv_cache():
    """Keys computed at the call by their own projection (no cache) and written in place after it: refused, and the
    error does not send the user to a KV cache setting that has nothing to do with it."""

    class Separate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):  # (B, H, N, 4)
            k = self.k(x)
            out = F.scaled_dot_product_attention(self.q(x), k, self.v(x))
            k.mul_(2.0)  # (after the call)
            return out

    torch.manual_seed(13)
    model = Separate().eval()
    with torch.no_grad(), vx.capture(model) as rec:
        model(torch.randn(1, 2, 5, 4))
    with pytest.raises(vx.CaptureError, match="overwritten in place") as error:
        rec.records[0].probs()
    assert "cache" not in str(error.value) and "materialize" in str(error.value)


def test_values_written_after_the_call_do_not_change_grad_probs_silently():
    """grad_probs of an SDPA record is dO V^T from the values it holds: v written in place after the call (once
    the backward ran) gave dO V'^T. Oracle: the given dO times the values cloned at the call."""
    torch.manual_seed(3)
    model = QKVAttention()
    x = torch.randn(2, 5, 8, requires_grad=True)
    with vx.capture(model, grads=True) as rec:
        model(x).square().sum().backward()
    record = rec.records[0]
    _, _, v_then, _ = model.seen[-1]
    d_out = torch.randn(2, 2, 5, 4)
    expected = d_out.double() @ v_then.double().transpose(-2, -1)
    assert right_or_refused(lambda: record.grad_probs(d_out=d_out), expected, "values") == "right"
    with torch.no_grad():
        model.last[2].mul_(-3.0)  # v, a view of the projection output
    assert right_or_refused(lambda: record.grad_probs(d_out=d_out), expected, "values") == "refused"


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_weights_nn_multihead_attention_returned_and_the_user_wrote_are_not_read_silently(grad_mode):
    """nn.MultiheadAttention (need_weights=True, per-head weights) returns a view of the probabilities its record
    holds: writing into the returned weights changed the record's probabilities."""
    torch.manual_seed(4)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    context = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    with context:
        with vx.capture(mha) as rec:
            _, weights = mha(x, x, x, need_weights=True, average_attn_weights=False)
        expected = weights.double().clone()
        record = rec.records[0]
        assert right_or_refused(record.probs, expected, "weights") == "right"
        weights[:, :, 1:3].mul_(0.5)
        assert right_or_refused(record.probs, expected, "weights") == "refused"


@pytest.mark.parametrize("case", ["q", "bool_mask"])
def test_the_remedy_the_error_names_keeps_the_calls_attention(case):
    """The error for SDPA records says to capture with attention_mode='materialize': its records keep each call's
    probabilities, so the same writes after the call leave them right."""
    torch.manual_seed(9)
    what, write = WRITES[case]
    model = QKVAttention().eval()
    model.after = write
    x = torch.randn(2, 5, 8)
    mask = _mask(5, True) if what == "mask" else None
    with torch.no_grad(), vx.capture(model, attention_mode="materialize") as rec:
        model(x, mask)
    q, k, _, m = model.seen[-1]
    assert rec.records[0].materialized
    assert right_or_refused(rec.records[0].probs, oracle(q, k, m), what) == "right"


def test_values_of_a_cache_written_before_the_call_are_told_by_their_sums():
    """Values already written in place before the call (a KV cache buffer) keep their sums as a witness: writing the
    same values again leaves grad_probs readable; writing another value (a later position) refuses it, since dO V^T
    at that position would come from values the call never saw."""
    torch.manual_seed(10)

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.values = torch.zeros(1, 2, 4, 4)

        def forward(self, q, k, v_new):
            self.values[:, :, :2] = v_new  # (the cache's version is no longer 0 at the call)
            mask = torch.tensor([True, True, False, False])[None, None, None]
            return F.scaled_dot_product_attention(q, k, self.values, attn_mask=mask)

    model = Cached()
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    k, v_new = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 2, 4)
    with vx.capture(model, grads=True) as rec:
        model(q, k, v_new).sum().backward()
    record = rec.records[0]
    then = model.values.clone()
    d_out = torch.randn(1, 2, 3, 4)
    expected = d_out.double() @ then.double().transpose(-2, -1)
    model.values[:, :, :2] = v_new  # the same values written again: the version moves, the sums do not
    assert right_or_refused(lambda: record.grad_probs(d_out=d_out), expected, "values") == "right"
    model.values[:, :, 2] = 1.0  # a position the call masked out, written by a later step
    assert right_or_refused(lambda: record.grad_probs(d_out=d_out), expected, "values") == "refused"


def test_an_mha_call_without_weights_stays_readable():
    """nn.MultiheadAttention with need_weights=False (SDPA inside, on q, k, v the user never sees): its records
    read right (oracle: MHA's weights from a second call that returns them)."""
    torch.manual_seed(5)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), vx.capture(mha) as rec:
        mha(x, x, x, need_weights=False)
    with torch.no_grad():
        _, weights = mha(x, x, x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(rec.records[0].probs().double(), weights.double(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_an_extractor_returning_a_buffer_written_at_every_call_is_not_read_silently(grad_mode):
    """A module that keeps its weights in a preallocated buffer, written in place at every call, read by
    ``from_attribute``: every record held the same buffer, so every step gave the last step's weights."""
    from vitexplain.recording import from_attribute

    class Additive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.alpha = torch.zeros(2, 6)
            self.w = nn.Linear(4, 1)

        def forward(self, query, keys):  # (B, 4), (B, 6, 4)
            self.alpha.copy_(torch.softmax(self.w(torch.tanh(keys + query[:, None])).squeeze(-1), -1))
            return (self.alpha[..., None] * keys).sum(1)

    torch.manual_seed(6)
    context = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    with context:
        module = Additive().eval()
        seen = []
        with vx.capture(module, attention={"": from_attribute("alpha")}) as rec:
            for _ in range(3):
                module(torch.randn(2, 4), torch.randn(2, 6, 4))
                seen.append(module.alpha.clone())
    outcomes = [right_or_refused(r.probs, w.double()[:, None, None], "weights") for r, w in zip(rec.records, seen)]
    assert outcomes == ["refused", "refused", "right"]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("what", ["queries", "block_mask"])
def test_flex_queries_or_block_mask_written_after_the_call_are_not_read_silently(what, grad_mode):
    """A FlexAttention record recomputes from q, k and the BlockMask's tensors: q written after the call, or the
    block mask's block counts rewritten in place (a mask reused across decoding steps), changed its probabilities
    or was blamed on how the mask was built."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(7)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    context = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    with context:
        block_mask = flex.create_block_mask(causal, None, None, 8, 8, device="cpu", BLOCK_SIZE=4)

        class Flex(nn.Module):
            def forward(self, q, k, v):
                return flex.flex_attention(q, k, v, block_mask=block_mask)

        q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
        expected = oracle(q.clone(), k.clone(), torch.ones(8, 8, dtype=torch.bool).tril())
        model = Flex().eval()
        with vx.capture(model) as rec:
            model(q, k, v)
        record = rec.records[0]
        assert right_or_refused(record.probs, expected, "") == "right"
        if what == "queries":
            q.mul_(2.0)
        else:  # (blocks that no longer agree with the mask_mod: the record used to blame the mask as built)
            block_mask.full_kv_num_blocks.zero_()
        named = {"queries": "queries", "block_mask": "BlockMask"}[what]
        assert right_or_refused(record.probs, expected, named) == "refused"


def _tiny_llama(seed: int):
    """A random-init two-layer Llama (SDPA, grouped-query heads), token ids (1, 6) and a causal 4-D float mask."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaModel(config).eval()
    ids = torch.randint(0, 32, (1, 6))
    causal = torch.zeros(1, 1, 6, 6).masked_fill_(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    return model, ids, causal


def test_a_hugging_face_mask_written_between_forwards_is_not_read_silently_on_any_path():
    """A 4-D mask given to a Hugging Face model reaches every layer's SDPA call as is. Written in place between
    two forwards (a preallocated mask updated as a decoding loop does), the first forward's records used to be
    recomputed with the new mask, on every path: the mode's, the checked path of recording/direct.py and, from
    the third capture of a model on, its lanes (whose records are made from the call's arguments when read).
    Oracle: the same forward captured alone, its records read at once."""
    model, ids, causal = _tiny_llama(8)
    opened = causal.clone()
    opened[..., 1, 2:4] = 0.0  # (row 1 now also attends to keys 2 and 3)
    lanes = []
    for _ in range(4):  # (captures 0-1: the mode and the checked path; from 2 on: lanes)
        with torch.no_grad(), vx.capture(model) as alone:
            model(input_ids=ids, attention_mask=causal.clone(), use_cache=False)
        expected = [r.probs().double() for r in alone.records]
        mask = causal.clone()
        with torch.no_grad(), vx.capture(model) as rec:
            model(input_ids=ids, attention_mask=mask, use_cache=False)
            lanes.append(sum(not isinstance(draft[-1], dict) for draft in rec._book.drafts))
            mask.copy_(opened)
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        first = [r for r in rec.records if r.forward_index == 0]
        assert len(first) == len(expected) == 2
        outcomes = [right_or_refused(r.probs, want, "mask") for r, want in zip(first, expected)]
        assert outcomes == ["refused"] * 2  # (the records keep the mask by reference: the write is seen)
    assert lanes[0] == 0 and lanes[-1] == 2  # (the last captures took the lanes)


def test_keys_a_lane_kept_written_before_its_record_is_made_are_refused():
    """A lane keeps a call's arguments and makes its record when the records are read (recording/direct.py): keys
    fresh at the call (version 0) but written in place before that were planned from as they were then (repeated
    for the query heads into a new tensor, version 0 again), silently. Oracle: the forward captured alone."""
    model, ids, causal = _tiny_llama(11)
    for _ in range(3):  # (from the third capture of the model on, its calls take their lanes)
        with torch.no_grad(), vx.capture(model) as alone:
            model(input_ids=ids, attention_mask=causal, use_cache=False)
        expected = [r.probs().double() for r in alone.records]
    with torch.no_grad(), vx.capture(model) as rec:
        model(input_ids=ids, attention_mask=causal, use_cache=False)
        pending = [draft[-1] for draft in rec._book.drafts if not isinstance(draft[-1], dict)]
        assert len(pending) == 2
        pending[0].args[1].mul_(-1.0)  # the first layer's keys, written before the records are read
    outcomes = [right_or_refused(r.probs, want, "keys") for r, want in zip(rec.records, expected)]
    assert outcomes == ["refused", "right"]
