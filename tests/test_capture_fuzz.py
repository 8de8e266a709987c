"""vx.capture fuzzed against eager float64 oracles written here (no vitexplain code in the oracles).

Every case checks what a user relies on: the record's ``probs()`` (and ``grad_probs()``) equal
``softmax(q k^T * scale + mask)`` computed in float64 by :func:`oracle`, the model's outputs under the
capture equal its outputs without it (bitwise where the fused kernel runs, 1e-5 where the capture
materialises attention), and the process and the model are left exactly as found.
"""

from __future__ import annotations

import math
import threading
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import vitexplain as vx

pytestmark = pytest.mark.usefixtures("one_thread")

_MHA_FORWARD = F.multi_head_attention_forward
_SDPA, _SOFTMAX = F.scaled_dot_product_attention, F.softmax


def oracle(q, k, mask=None, *, causal=False, scale=None):
    """softmax(q k^T * scale + mask) in float64, (..., H, N_q, N_k); key heads repeated for fewer key heads;
    rows in which every key is masked give zeros (as the fused kernels do)."""
    q, k = q.detach().double(), k.detach().double()
    if k.dim() == q.dim() and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
    s = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.nan_to_num(torch.softmax(s, -1), nan=0.0)


def mha_oracle(mha: nn.MultiheadAttention, query, key, *, key_padding_mask=None, attn_mask=None):
    """nn.MultiheadAttention's (B, H, N_q, N_k') weights written out in float64 from its parameters (batch_first
    inputs; N_k' counts the bias key of ``add_bias_kv`` and the zero key of ``add_zero_attn``); masks as MHA reads
    them (bool: True = masked out; float: added)."""
    d, h = mha.embed_dim, mha.num_heads
    if mha.in_proj_weight is not None:
        w_q, w_k, _ = mha.in_proj_weight.detach().double().chunk(3)
    else:
        w_q, w_k = mha.q_proj_weight.detach().double(), mha.k_proj_weight.detach().double()
    b_q, b_k, _ = mha.in_proj_bias.detach().double().chunk(3)
    b, n_q = query.shape[:2]
    q = (query.double() @ w_q.T + b_q).view(b, n_q, h, d // h).transpose(1, 2)
    k = key.double() @ w_k.T + b_k  # (B, N_k, D)
    extra = 0
    if mha.bias_k is not None:
        k = torch.cat([k, mha.bias_k.detach().double().view(1, 1, d).expand(b, 1, d)], 1)
        extra += 1
    k = k.view(b, -1, h, d // h).transpose(1, 2)
    if mha.add_zero_attn:
        k = torch.cat([k, k.new_zeros(b, h, 1, d // h)], 2)
        extra += 1
    s = q @ k.transpose(-2, -1) / math.sqrt(d // h)
    for m, padding in ((attn_mask, False), (key_padding_mask, True)):
        if m is None:
            continue
        m = m.view(b, 1, 1, -1) if padding else (m if m.dim() == 2 else m.view(b, h, *m.shape[-2:]))
        m = F.pad(m, (0, extra))  # (the extra keys are never masked)
        s = s.masked_fill(m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    return torch.softmax(s, -1)


class _During(TorchFunctionMode):
    """A mode under the capture's: calls ``during()`` when MHA's functional forward reaches it, i.e. while the
    capture above is handling that call (after it made the forward's attention visible to itself)."""

    def __init__(self, during) -> None:
        super().__init__()
        self.during = during

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _MHA_FORWARD:
            self.during()
        return func(*args, **(kwargs or {}))


def test_mha_captures_in_two_threads_record_their_own_attention_and_leave_torch_as_found():
    """Thread A's capture is inside an MHA forward when thread B's capture enters one, and leaves it before B's
    forward ends. Each capture must record its own call (and only it), and torch.nn.functional must end as found:
    the captures used to save each other's patched functions as the originals, leaving F patched for good and B's
    attention unrecorded."""
    mha_a = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    mha_b = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x_a, x_b = torch.randn(2, 5, 16), torch.randn(3, 6, 16)
    b_inside, a_done = threading.Event(), threading.Event()
    found: dict = {}
    fast = torch.backends.mha.get_fastpath_enabled()

    def thread_b() -> None:
        try:
            torch.set_num_threads(1)
            with torch.no_grad(), _During(lambda: (b_inside.set(), a_done.wait(10))), vx.capture(mha_b) as rec:
                found["out"] = mha_b(x_b, x_b, x_b, need_weights=False)[0]
            found["records"] = rec.records
        except BaseException as error:  # (reported in the main thread)
            found["error"] = error
        b_inside.set()

    worker = threading.Thread(target=thread_b)

    def start_b() -> None:
        worker.start()
        assert b_inside.wait(10)

    with torch.no_grad(), _During(start_b), vx.capture(mha_a) as rec_a:
        out_a = mha_a(x_a, x_a, x_a, need_weights=False)[0]
    a_done.set()
    worker.join(10)
    assert F.scaled_dot_product_attention is _SDPA and F.softmax is _SOFTMAX
    assert torch.backends.mha.get_fastpath_enabled() is fast
    assert "error" not in found, found.get("error")
    for rec, records, mha, x, out in ((rec_a, rec_a.records, mha_a, x_a, out_a),
                                      (None, found["records"], mha_b, x_b, found["out"])):
        (record,) = records
        assert record.q_shape[:2] == (x.shape[0], mha.num_heads)
        torch.testing.assert_close(record.probs().double(), mha_oracle(mha, x, x), atol=1e-6, rtol=0)
        with torch.no_grad():  # (the capture runs MHA's Python path, not its C++ fast path: equal to rounding)
            torch.testing.assert_close(out, mha(x, x, x, need_weights=False)[0], atol=1e-6, rtol=0)


class _FlexCache(nn.Module):
    """FlexAttention over a static KV cache (written in place, one position per call, as gpt-fast does); with
    ``causal``, a score_mod hides the positions not written yet."""

    def __init__(self, causal: bool, heads: int = 2, dim: int = 4, length: int = 5) -> None:
        super().__init__()
        self.causal = causal
        self.register_buffer("k_cache", torch.zeros(1, heads, length, dim))
        self.register_buffer("v_cache", torch.zeros(1, heads, length, dim))

    def forward(self, q, k, v, pos: int):
        from torch.nn.attention.flex_attention import flex_attention

        self.k_cache[:, :, pos] = k[:, :, 0]
        self.v_cache[:, :, pos] = v[:, :, 0]

        def hide_future(score, b, h, q_idx, kv_idx):
            return torch.where(kv_idx <= pos, score, -float("inf"))

        return flex_attention(q, self.k_cache, self.v_cache, score_mod=hide_future if self.causal else None)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [True, False], ids=["future_hidden", "all_attended"])
def test_flex_records_over_a_static_kv_cache_are_right_or_refused(causal):
    """A FlexAttention record keeps the cache tensor itself; the next step writes into it. Records whose attended
    keys were overwritten used to give probabilities from the new keys, silently (SDPA records refuse them)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = _FlexCache(causal).eval()
    expected = []
    with torch.no_grad(), vx.capture(model) as rec:
        for pos in range(3):
            q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
            model(q, k, k, pos)
            mask = torch.arange(5) <= pos if causal else None
            expected.append(oracle(q, model.k_cache, mask))  # the keys as this call saw them
    assert [r.source for r in rec.records] == ["flex"] * 3
    for step, (record, want) in enumerate(zip(rec.records, expected)):
        if causal or step == 2:  # (the last step's keys were not written since)
            torch.testing.assert_close(record.probs().double(), want, atol=1e-6, rtol=0)
        else:
            with pytest.raises(vx.CaptureError, match="overwritten in place"):
                record.probs()


class _Attend(nn.Module):
    """Calls SDPA on its inputs with fixed keyword arguments."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.kwargs)


@pytest.mark.parametrize("mode", ["fused", "materialize"])
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_an_sdpa_call_without_heads_is_recorded_as_one_head(mode, bias):
    """SDPA on (B, N, E) (SAM folds its heads into B): its record has one head, so probs() is (B, 1, N_q, N_k) like
    grad_probs() and every other record, and a head fusion is that head. Its probs() used to be (B, N_q, N_k), so
    fused_probs('mean') averaged over the query rows, (B, N_k), and probs() * grad_probs() broadcast to (B, B, ...)."""
    q, k, v = torch.randn(3, 5, 4, requires_grad=True), torch.randn(3, 7, 4), torch.randn(3, 7, 6)
    mask = torch.randn(3, 5, 7) if bias else None
    module = _Attend(attn_mask=mask)
    want = oracle(q, k, mask)[:, None]  # (B, 1, N_q, N_k)
    with vx.capture(module, grads=True, attention_mode=mode) as rec:
        out = module(q, k, v)
    cotangent = torch.randn_like(out)
    rec.backward((out * cotangent).sum())
    (record,) = rec.records
    assert record.num_heads == 1 and record.materialized == (mode == "materialize")
    torch.testing.assert_close(record.probs().double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(record.probs(queries=slice(1, 3)).double(), want[:, :, 1:3], atol=1e-6, rtol=0)
    for fusion in ("mean", "max", "min"):
        torch.testing.assert_close(record.fused_probs(fusion).double(), want[:, 0], atol=1e-6, rtol=0)
    d_probs = (cotangent.double() @ v.double().transpose(-2, -1))[:, None]  # dy/dA = dO V^T
    torch.testing.assert_close(record.grad_probs().double(), d_probs, atol=1e-5, rtol=1e-5)


def test_a_materializing_capture_takes_dy_da_when_only_the_values_require_grad():
    """q and k constant, v in the graph (e.g. frozen query/key projections): dy/dA = dO V^T is defined. With
    attention_mode='materialize' the probabilities were outside the graph, so the record said the forward had no
    autograd graph and rec.backward refused to run."""
    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4, requires_grad=True)
    module = _Attend()
    want = module(q, k, v)
    with vx.capture(module, grads=True, attention_mode="materialize") as rec:
        out = module(q, k, v)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    cotangent = torch.randn_like(out)
    rec.backward((out * cotangent).sum())
    (record,) = rec.records
    torch.testing.assert_close(record.probs().double(), oracle(q, k), atol=1e-6, rtol=0)
    torch.testing.assert_close(record.grad_probs().double(), cotangent.double() @ v.detach().double().transpose(-2, -1),
                               atol=1e-5, rtol=1e-5)


def test_one_model_captured_in_two_threads_at_once(monkeypatch):
    """torch numbers hook handles with a class counter it reads, then increments: two threads registering hooks at
    once can get one id, and on one module the second hook replaces the first (a capture then lost its own hooks:
    a TypeError from a hook called without its kwargs, or records missing). The window is widened here (a switch
    of threads between the read and the increment, as the interpreter may make); each capture must record its own
    forward (and count it), equal to the float64 oracle, and the model must end without hooks."""
    from torch.utils import hooks

    def widened(self, hooks_dict, *, extra_dict=None):
        number = hooks.RemovableHandle.next_id
        time.sleep(0.002)
        hooks.RemovableHandle.next_id = number + 1
        self.hooks_dict_ref = weakref.ref(hooks_dict)
        self.id = number
        dicts = [extra_dict] if isinstance(extra_dict, dict) else list(extra_dict or [])
        self.extra_dict_ref = tuple(weakref.ref(d) for d in dicts)

    monkeypatch.setattr(hooks.RemovableHandle, "__init__", widened)
    model = _QKV().eval()
    inputs = [torch.randn(2, 5, 8), torch.randn(3, 4, 8)]
    failures: list = []
    together = threading.Barrier(2)

    def run(x) -> None:
        try:
            torch.set_num_threads(1)
            for _ in range(3):
                together.wait(10)  # both threads enter their captures at once
                with torch.no_grad(), vx.capture(model) as rec:
                    model(x)
                (record,) = rec.records
                assert rec.forward_count == 1  # (its input hook was not replaced by the other capture's)
                torch.testing.assert_close(record.probs().double(), model.oracle(x), atol=1e-6, rtol=0)
        except BaseException as error:  # (reported in the main thread)
            failures.append(error)

    workers = [threading.Thread(target=run, args=(x,)) for x in inputs]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert not failures, failures
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class _QKV(nn.Module):
    """One attention layer (two heads) calling SDPA; ``oracle(x)`` its probabilities in float64."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def _qk(self, x):
        b, n, d = x.shape
        return self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)

    def forward(self, x, mask=None):
        q, k, v = self._qk(x)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)

    def oracle(self, x):
        q, k, _ = self._qk(x)
        return oracle(q, k)


class _RootBranch(nn.Module):
    """A model whose own forward computes attention (a 4-D softmax) only when ``eager`` is set, and otherwise
    calls an attention layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = _QKV()
        self.eager = False

    def forward(self, x):
        if not self.eager:
            return self.layer(x)
        q = x.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        return (torch.softmax(q @ q.transpose(-2, -1) / 2, dim=-1) @ q).transpose(1, 2).flatten(2)


def test_attention_the_model_itself_issues_on_a_later_forward_is_recorded():
    """After the first forward a capture intercepts only where attention can be issued; the model itself was never
    among those places, so attention its own forward computes on a branch the first forward did not take was
    missed, silently (a later capture of the same model starts narrowed: NoAttentionError)."""
    model = _RootBranch().eval()
    x = torch.randn(2, 5, 8)
    q = x.view(2, 5, 2, 4).transpose(1, 2)
    with torch.no_grad(), vx.capture(model) as rec:
        model(x)
        model.eager = True
        model(x)
    assert [(r.name, r.forward_index) for r in rec.records] == [("layer", 0), ("", 1)]
    torch.testing.assert_close(rec.records[0].probs().double(), model.layer.oracle(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(rec.records[1].probs().double(), oracle(q, q, scale=0.5), atol=1e-6, rtol=0)
    with torch.no_grad(), vx.capture(model) as again:  # (starts from what the first capture learned)
        model(x)
    (record,) = again.records
    assert record.name == ""
    torch.testing.assert_close(record.probs().double(), oracle(q, q, scale=0.5), atol=1e-6, rtol=0)


def _stance() -> str:
    """The compiler's stance now (torch keeps it in one process-wide setting)."""
    from torch._dynamo import eval_frame

    return eval_frame._stance.stance


def test_captures_of_compiled_models_in_two_threads_share_the_eager_stance():
    """A capture of a torch.compile-d model runs it eagerly ("force_eager", a process-wide setting). Thread A's
    capture closes while thread B's is open: B's model must still run eagerly (its attention recorded), and the
    stance must end as found. Each capture used to restore what it had found itself: A switched compiling back on
    under B, and B, closing last, restored A's "force_eager": torch.compile off for the whole process."""
    found = _stance()
    model_a, model_b = torch.compile(_QKV().eval()), torch.compile(_QKV().eval())
    x = torch.randn(2, 5, 8)
    b_open, a_closed = threading.Event(), threading.Event()
    result: dict = {}

    def thread_b() -> None:
        try:
            torch.set_num_threads(1)
            with torch.no_grad(), vx.capture(model_b) as rec:
                b_open.set()
                assert a_closed.wait(10)
                result["stance"] = _stance()
                if result["stance"] == "force_eager":  # (else the call would compile: slow, and not recorded)
                    model_b(x)
            result["records"] = rec.records
        except BaseException as error:  # (reported in the main thread)
            result["error"] = error
        b_open.set()

    worker = threading.Thread(target=thread_b)
    with torch.no_grad(), vx.capture(model_a) as rec_a:
        worker.start()
        assert b_open.wait(10)
        model_a(x)
    a_closed.set()
    worker.join(10)
    assert "error" not in result, result.get("error")
    assert result["stance"] == "force_eager" and _stance() == found
    for records, model in ((rec_a.records, model_a), (result["records"], model_b)):
        (record,) = records
        torch.testing.assert_close(record.probs().double(), model._orig_mod.oracle(x), atol=1e-6, rtol=0)


class _FlexOffset(nn.Module):
    """FlexAttention whose score_mod reads a tensor the model writes in place before each call (a decoding offset
    kept in one tensor, so that compiled code does not recompile): keys past the offset are hidden."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.zeros((), dtype=torch.long))

    def forward(self, q, k, v, pos: int):
        from torch.nn.attention.flex_attention import flex_attention

        self.offset.fill_(pos)
        offset = self.offset

        def hide_after_offset(score, b, h, q_idx, kv_idx):
            return torch.where(kv_idx <= offset, score, -float("inf"))

        return flex_attention(q, k, v, score_mod=hide_after_offset)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_records_whose_score_mod_reads_a_tensor_written_since_are_refused():
    """The record recomputes with the call's score_mod, which reads the offset tensor as it is *now*: after the
    next step wrote it, the first step's probabilities came out with the second step's offset, silently."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = _FlexOffset().eval()
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 6, 4)
    with torch.no_grad(), vx.capture(model) as rec:
        model(q, k, k, 1)
        first = rec.records[0].probs()  # read before the next write: right
        model(q, k, k, 4)
    torch.testing.assert_close(first.double(), oracle(q, k, torch.arange(6) <= 1), atol=1e-6, rtol=0)
    with pytest.raises(vx.CaptureError, match="written in place after the call"):
        rec.records[0].probs()
    torch.testing.assert_close(rec.records[1].probs().double(), oracle(q, k, torch.arange(6) <= 4), atol=1e-6, rtol=0)


def _sdpa_cases():
    """(name, (q, k, v), SDPA keyword arguments): every mask form and input layout SDPA takes."""
    b, h, n, e = 2, 3, 5, 4
    r = torch.randn
    cases = []
    for shape in [(1, n), (n, n), (1, n, n), (h, n, n), (b, 1, n, n), (b, h, n, n), (b, 1, 1, n), (b, h, n, 1), (n, 1)]:
        keep = torch.rand(shape) > 0.3
        cases.append((f"bool{shape}", (r(b, h, n, e), r(b, h, n, e), r(b, h, n, e)), {"attn_mask": keep}))
        bias = torch.where(keep, r(shape), torch.tensor(-float("inf")))
        cases.append((f"float{shape}", (r(b, h, n, e), r(b, h, n, e), r(b, h, n, e)), {"attn_mask": bias}))
    for n_q, n_k in [(3, 6), (6, 3), (1, 5), (5, 1)]:
        cases.append((f"causal{n_q}x{n_k}", (r(b, h, n_q, e), r(b, h, n_k, e), r(b, h, n_k, e)), {"is_causal": True}))
    qkv = r(b, n, 3, h, e).permute(2, 0, 3, 1, 4)  # timm's strided q, k, v
    f64, bf16 = torch.float64, torch.bfloat16
    cases += [
        ("scale", (r(b, h, n, e), r(b, h, 7, e), r(b, h, 7, 6)), {"scale": 0.77}),
        ("gqa", (r(b, 6, n, e), r(b, 2, 7, e), r(b, 2, 7, e)),
         {"enable_gqa": True, "attn_mask": torch.rand(b, 6, n, 7) > 0.2}),
        ("3d", (r(b, n, e), r(b, 7, e), r(b, 7, e)), {"attn_mask": r(n, 7)}),
        ("5d", (r(b, 2, h, n, e), r(b, 2, h, n, e), r(b, 2, h, n, e)), {"attn_mask": r(2, 1, n, n)}),
        ("5d_causal", (r(b, 2, h, n, e), r(b, 2, h, n, e), r(b, 2, h, n, e)), {"is_causal": True}),
        ("5d_kv_broadcast", (r(b, 2, h, n, e), r(b, 1, h, n, e), r(2, h, n, e)), {}),
        ("q_broadcast", (r(1, h, n, e), r(b, h, 7, e), r(b, h, 7, e)), {"attn_mask": r(b, 1, n, 7)}),
        ("5d_q_broadcast", (r(1, 2, h, n, e), r(b, 2, h, n, e), r(b, 2, h, n, e)), {"attn_mask": r(n, n)}),
        ("strided", tuple(qkv.unbind(0)), {}),
        ("k_transposed", (r(b, h, n, e), r(b, h, e, n).transpose(-1, -2), r(b, h, n, e)), {}),
        ("float64", (r(b, h, n, e, dtype=f64), r(b, h, n, e, dtype=f64), r(b, h, n, e, dtype=f64)),
         {"attn_mask": r(n, n, dtype=f64)}),
        ("bfloat16", (r(b, h, n, e, dtype=bf16), r(b, h, n, e, dtype=bf16), r(b, h, n, e, dtype=bf16)),
         {"attn_mask": r(n, n, dtype=bf16)}),
        ("empty_batch", (r(0, h, n, e), r(0, h, n, e), r(0, h, n, e)), {}),
        ("one_token", (r(b, h, 1, e), r(b, h, 1, e), r(b, h, 1, e)), {}),
    ]
    return cases


@pytest.mark.parametrize("mode", ["fused", "materialize"])
@pytest.mark.parametrize("grads", [False, True], ids=["no_grads", "grads"])
def test_sdpa_calls_of_every_form_equal_the_float64_oracle(mode, grads):
    """Every SDPA form (mask shapes and kinds, causal with N_q != N_k, scale, GQA, 3-D and 5-D inputs, strided,
    float64, bfloat16, empty batch, one token; only q requiring grad): probs() and grad_probs() equal the float64
    oracle, the outputs equal the uncaptured call's (bitwise with the fused kernel). 5-D calls whose leading dims
    SDPA broadcasts (keys shared by the windows) gave a RuntimeError from probs(); queries shared by the images
    gave a record of batch 1 whose probs() had the keys' batch."""
    for name, (q, k, v), kwargs in _sdpa_cases():
        q = q.detach().requires_grad_(grads)  # (k and v constants: only some inputs require grad)
        module = _Attend(**kwargs)
        with torch.set_grad_enabled(grads):
            want = module(q, k, v)
            with vx.capture(module, attention_mode=mode, grads=grads) as rec:
                got = module(q, k, v)
        if mode == "fused" or not rec.records[0].materialized:
            assert torch.equal(got, want), name
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)
        (record,) = rec.records
        expected = oracle(q, k, kwargs.get("attn_mask"), causal=kwargs.get("is_causal", False),
                          scale=kwargs.get("scale"))
        expected = expected.reshape(record.q_shape[0], record.num_heads, *expected.shape[-2:])  # (5-D: windows in B)
        torch.testing.assert_close(record.probs().double(), expected, atol=1e-6, rtol=0, msg=name)
        if grads and q.shape[0]:
            cotangent = torch.randn_like(got)
            rec.backward((got * cotangent).sum())
            values = v.double()
            if values.dim() == q.dim() and values.shape[-3] != q.shape[-3]:
                values = values.repeat_interleave(q.shape[-3] // values.shape[-3], -3)
            d_probs = (cotangent.double() @ values.transpose(-2, -1)).reshape(expected.shape)  # dO V^T
            torch.testing.assert_close(record.grad_probs().double(), d_probs, atol=1e-4, rtol=1e-3, msg=name)


class _SDPACache(nn.Module):
    """SDPA over a KV cache buffer made at the first step and written in place at every step (every key attended)."""

    def forward(self, q, k, v, pos: int):
        if pos == 0:
            self.k_cache, self.v_cache = torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4)
        self.k_cache[:, :, pos] = k[:, :, 0]
        self.v_cache[:, :, pos] = v[:, :, 0]
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_keys_and_mod_tensors_written_in_place_under_inference_mode_are_read_as_the_call_saw_them_or_refused():
    """Under torch.inference_mode tensors keep no count of their in-place writes, so the witness of a cache's keys
    (and of a FlexAttention offset) was skipped: earlier steps' records recomputed from the keys of later steps,
    silently. A decoding SDPA call over such keys keeps its probabilities, computed at the call (early.py): every
    step reads as the call saw them (they were refused before that); a FlexAttention record whose offset was
    written since is refused. Records whose keys were not written since still read right."""
    model = _SDPACache().eval()
    expected = []
    with torch.inference_mode(), vx.capture(model) as rec:
        for pos in range(3):
            q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
            model(q, k, k, pos)
            expected.append(oracle(q, model.k_cache))
        fresh = _QKV().eval()
        x = torch.randn(2, 5, 8)
        with vx.capture(fresh) as fresh_rec:
            fresh(x)
    assert len(rec.records) == 3
    for record, want in zip(rec.records, expected):
        torch.testing.assert_close(record.probs().double(), want, atol=1e-6, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(fresh_rec.records[0].probs().double(), fresh.oracle(x), atol=1e-6, rtol=0)
    pytest.importorskip("torch.nn.attention.flex_attention")
    flex_model = _FlexOffset().eval()
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 6, 4)
    with torch.inference_mode():
        flex_model.offset = torch.zeros((), dtype=torch.long)  # (an inference tensor)
        with vx.capture(flex_model) as flex_rec:
            flex_model(q, k, k, 1)
            flex_model(q, k, k, 4)
    with pytest.raises(vx.CaptureError, match="written in place after the call"):
        flex_rec.records[0].probs()
    torch.testing.assert_close(flex_rec.records[1].probs().double(), oracle(q, k, torch.arange(6) <= 4),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("path", ["batched", "per_image", "chunks"])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_a_capture_around_a_materializing_capture_records_the_models_calls(path, masked, monkeypatch):
    """An inner capture that computed the attention itself (attention_mode='materialize', or 'auto' as the
    Explainer asks on a CPU) ran its own softmax where the outer capture saw it: the outer capture recorded one
    'eager' record per image or per chunk (batch 1 or 2 instead of 3), or none at all for a masked call (whose
    softmax is torch's _safe_softmax), silently."""
    from vitexplain.recording import materialize

    minimum, chunk = {"batched": (2**62, 2**62), "per_image": (0, 0), "chunks": (0, 2 * 2 * 5 * 5 * 4)}[path]
    monkeypatch.setattr(materialize, "PER_IMAGE_MIN", minimum)
    monkeypatch.setattr(materialize, "CHUNK_BYTES", chunk)
    model = _QKV().eval()
    x = torch.randn(3, 5, 8)
    mask = torch.rand(5, 5) > 0.3 if masked else None
    with torch.no_grad():
        want = model(x, mask)
        with vx.capture(model) as outer, vx.capture(model, attention_mode="materialize") as inner:
            got = model(x, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    q, k, _ = model._qk(x)
    for rec in (outer, inner):
        (record,) = rec.records
        assert record.q_shape[0] == 3
        torch.testing.assert_close(record.probs().double(), oracle(q, k, mask), atol=1e-6, rtol=0)


def test_multihead_attention_in_every_setting_equals_the_float64_oracle():
    """nn.MultiheadAttention: batch_first or not, kdim/vdim, add_bias_kv, add_zero_attn, key_padding_mask bool or
    float, attn_mask 2-D or 3-D, need_weights (averaged or not), eval without grad (its C++ fast path outside the
    capture): one record per call equal to the oracle, outputs equal to the uncaptured call's, torch as found."""
    import itertools

    b, n_q, n_k = 2, 4, 5
    fast = torch.backends.mha.get_fastpath_enabled()
    for batch_first, kdim, bias_kv, zero_attn, padding, mask, weights in itertools.product(
            [True, False], [None, 6], [False, True], [False, True], [None, "bool", "float"], [None, "2d", "3d"],
            [None, "averaged", "per_head"]):
        mha = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=kdim, vdim=kdim, add_bias_kv=bias_kv,
                                    add_zero_attn=zero_attn).eval()
        query, key = torch.randn(b, n_q, 8), torch.randn(b, n_k, kdim or 8)
        kwargs: dict = {"need_weights": weights is not None, "average_attn_weights": weights == "averaged"}
        if padding is not None:
            keep = torch.zeros(b, n_k, dtype=torch.bool)
            keep[0, -1] = True
            kwargs["key_padding_mask"] = keep if padding == "bool" else torch.randn(b, n_k)
        if mask is not None:
            kwargs["attn_mask"] = torch.randn(n_q, n_k) if mask == "2d" else torch.randn(b * 2, n_q, n_k)
            if padding == "bool":  # (MHA wants both masks of one kind)
                kwargs["attn_mask"] = kwargs["attn_mask"] > 1.0
        inputs = (query, key, key) if batch_first else (query.transpose(0, 1), key.transpose(0, 1), key.transpose(0, 1))
        with torch.no_grad():
            want = mha(*inputs, **kwargs)[0]
            with vx.capture(mha) as rec:
                got = mha(*inputs, **kwargs)[0]
        case = (batch_first, kdim, bias_kv, zero_attn, padding, mask, weights)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=str(case))  # (the fast path runs outside)
        (record,) = rec.records
        assert record.kind == "cross" and record.source == ("eager" if weights else "sdpa"), case
        expected = mha_oracle(mha, query, key, key_padding_mask=kwargs.get("key_padding_mask"),
                              attn_mask=kwargs.get("attn_mask"))
        torch.testing.assert_close(record.probs().double(), expected, atol=1e-6, rtol=0, msg=str(case))
    assert torch.backends.mha.get_fastpath_enabled() is fast
    assert F.scaled_dot_product_attention is _SDPA and F.softmax is _SOFTMAX


def _capture_backward_in_a_thread() -> dict:
    """In a new thread: a capture with gradients, the user's own backward, and its dy/dA (or the error)."""
    result: dict = {}

    def run() -> None:
        try:
            torch.set_num_threads(1)
            q, k, v = torch.randn(2, 3, 5, 4, requires_grad=True), torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
            module = _Attend()
            with vx.capture(module, grads=True) as rec:
                out = module(q, k, v)
            cotangent = torch.randn_like(out)
            (out * cotangent).sum().backward()
            result["got"] = rec.records[0].grad_probs().double()
            result["want"] = cotangent.double() @ v.double().transpose(-2, -1)
        except BaseException as error:  # (reported by the caller)
            result["error"] = error

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(30)
    return result


@pytest.mark.parametrize("while_", ["rec_backward", "hooks_paused"])
def test_a_capture_in_another_thread_gets_its_gradients_while_a_backward_pass_is_paused(while_):
    """rec.backward (and a method's own pass inside hooks_paused, as the Explainer runs every method) paused
    every record's gradient hook in the whole process: a capture's backward in another thread at that moment got
    no gradient ('no gradient has reached'), or only part of it when it accumulated several."""
    found: dict = {}
    if while_ == "hooks_paused":
        with vx.recording.hooks_paused():
            found.update(_capture_backward_in_a_thread())
    else:
        module = _Attend()
        q = torch.randn(1, 2, 4, 4, requires_grad=True)
        with vx.capture(module, grads=True) as rec:
            out = module(q, q, q)
        out.register_hook(lambda grad: found.update(_capture_backward_in_a_thread()))  # (runs inside the pass)
        rec.backward(out.sum())
        assert rec.records[0].grad_probs().shape == (1, 2, 4, 4)
    assert "error" not in found, found.get("error")
    torch.testing.assert_close(found["got"], found["want"], atol=1e-5, rtol=1e-5)


class _Additive(nn.Module):
    """Bahdanau attention, ``softmax_i(v . tanh(W q + k_i))``; returns (context, weights)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.W, self.v = nn.Linear(dim, dim), nn.Linear(dim, 1)

    def forward(self, query, keys):
        weights = torch.softmax(self.v(torch.tanh(self.W(query)[:, None] + keys)).squeeze(-1), -1)
        return (weights[..., None] * keys).sum(1), weights


class _Attends(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att, self.proj = _Additive(), nn.Linear(8, 8)

    def forward(self, query, keys):
        return self.proj(self.att(query, keys)[0])


def test_another_threads_calls_of_the_model_are_not_recorded_by_module_hooks():
    """Declared attention modules and activations are recorded by forward hooks, which fire in every thread
    that runs the model: a call of the captured model from another thread during the scope was recorded as
    the capture's own (records of another batch, step numbers shifted), silently."""
    from vitexplain.recording import from_output

    model = _Attends().eval()
    query, keys = torch.randn(2, 8), torch.randn(2, 5, 8)

    def elsewhere() -> None:
        with torch.no_grad():
            model(torch.randn(3, 8), torch.randn(3, 7, 8))

    with torch.no_grad(), vx.capture(model, attention={"att": from_output(1, "cross")}, activations=["proj"]) as rec:
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join(10)
        model(query, keys)
    (record,) = rec.records
    assert (record.name, record.step, record.source) == ("att", 0, "module")
    hidden = torch.tanh((query.double() @ model.att.W.weight.double().T + model.att.W.bias.double())[:, None] + keys)
    expected = torch.softmax(hidden @ model.att.v.weight.double()[0] + model.att.v.bias.double(), -1)
    torch.testing.assert_close(record.probs().double(), expected[:, None, None], atol=1e-6, rtol=0)
    (call,) = rec.activations["proj"]
    assert call.output.shape == (2, 8)


@pytest.mark.parametrize("capture", ["first", "lanes"])
def test_a_sliding_window_cache_reads_as_each_step_saw_it(capture):
    """Hugging Face's static sliding-window cache overwrites keys that earlier steps attended. Records kept the
    keys by reference: under no_grad they refused probs(), and under torch.inference_mode (keys keep no write
    count) they recomputed from the overwritten keys, silently. A decoding step over keys written in place now
    keeps its probabilities, computed at the call (recording/early.py): every step reads as it saw the cache,
    on the checked path and on the lanes a later capture takes. Oracle: the same weights with eager attention,
    generate(output_attentions=True)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=60, sliding_window=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    eager = transformers.MistralForCausalLM._from_config(config, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    ids = torch.randint(3, 60, (1, 5))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        oracle = eager.generate(ids, output_attentions=True, return_dict_in_generate=True, **kw)
    want = [layer for step in oracle.attentions for layer in step]  # prompt, then each step; layers in order

    for mode in (torch.no_grad, torch.inference_mode):
        if capture == "lanes":
            with mode(), vx.capture(model):  # (the first capture checks the calls; the next one takes the lanes)
                model.generate(ids, **kw)
        with mode(), vx.capture(model) as rec:
            out = model.generate(ids, **kw)
        assert torch.equal(out, oracle.sequences)
        assert len(rec.records) == len(want) == 8
        for record, expected in zip(rec.records, want):
            torch.testing.assert_close(record.probs(), expected, atol=1e-6, rtol=0)
