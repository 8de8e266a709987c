"""attention_mode: a capture that computes attention itself equals the fused kernel.

Oracles: the plain model (its fused SDPA kernel) for outputs and input gradients;
``F.scaled_dot_product_attention`` itself for masked, causal, grouped-query and windowed
calls; the capture's default fused mode (probabilities recomputed from q and k, tested
against eager attention in test_capture.py) for probabilities, dy/dA and every method's maps.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitexplain as vx
import vitexplain.explainer as explainer_module
from vitexplain.errors import CaptureError, UsageError
from vitexplain.recording import materialize
from vitexplain.recording.records import AttentionRecord

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
#: (PER_IMAGE_MIN, CHUNK_BYTES) that force each implementation of the materialised attention: the whole batch
#: at once, one image at a time, and chunks of two images (5000 bytes: two of TINY's 2 x 17 x 17 float32 scores,
#: so a batch of 3 also has a chunk of one)
PATHS = {"batched": (2**62, 2**62), "per_image": (0, 0), "chunks": (0, 5000)}


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    minimum, chunk = PATHS[request.param]
    monkeypatch.setattr(materialize, "PER_IMAGE_MIN", minimum)
    monkeypatch.setattr(materialize, "CHUNK_BYTES", chunk)
    return request.param


class Attend(nn.Module):
    """Calls SDPA with fixed keyword arguments."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.kwargs)


def _mask_with_dead_row(shape, dtype):
    mask = torch.rand(shape) > 0.3
    mask[..., 0] = True
    mask[..., 2, :] = False  # every key masked: the fused kernel gives zeros
    if dtype == torch.bool:
        return mask
    return torch.zeros(shape).masked_fill(~mask, float("-inf"))


def _biased_mask(shape, fill, dead_row=False):
    """A random bias with about a third of the keys of each row set to ``fill`` (key 0 never); with
    ``dead_row`` row 2 wholly ``fill`` (with -inf every key masked: the fused kernel gives zeros, a plain
    softmax NaN)."""
    bias = torch.randn(shape)
    drop = torch.rand(shape) < 0.3
    drop[..., 0] = False
    if dead_row:
        drop[..., 2, :] = True
    return bias.masked_fill(drop, fill)


def sdpa_cases():
    b, h, n, e = 2, 3, 7, 8
    qkv = torch.randn(b, n, 3, h, e).permute(2, 0, 3, 1, 4)  # timm's strided q, k, v
    cases = {
        "plain": ((torch.randn(b, h, n, e), torch.randn(b, h, n, e), torch.randn(b, h, n, e)), {}),
        "strided": (tuple(qkv.unbind(0)), {}),
        "scale": ((torch.randn(b, h, n, e), torch.randn(b, h, n, e), torch.randn(b, h, n, e)), {"scale": 0.3}),
        "bool_mask": ((torch.randn(b, h, n, e), torch.randn(b, h, n, e), torch.randn(b, h, n, 5)),
                      {"attn_mask": _mask_with_dead_row((n, n), torch.bool)}),
        "float_mask_cross": ((torch.randn(b, h, n, e), torch.randn(b, h, 9, e), torch.randn(b, h, 9, e)),
                             {"attn_mask": _mask_with_dead_row((b, 1, n, 9), torch.float32)}),
        "causal": ((torch.randn(b, h, n, e), torch.randn(b, h, n, e), torch.randn(b, h, n, e)), {"is_causal": True}),
        "gqa": ((torch.randn(b, 6, n, e), torch.randn(b, 2, n, e), torch.randn(b, 2, n, e)), {"enable_gqa": True}),
        "windows": ((torch.randn(b, 4, h, n, e), torch.randn(b, 4, h, n, e), torch.randn(b, 4, h, n, e)), {}),
        # heads folded into the batch, SDPA on (B * H, N, E) (timm's SAM), with and without its
        # relative-position bias as a per-call float mask
        "no_heads": ((torch.randn(b * h, n, e), torch.randn(b * h, n, e), torch.randn(b * h, n, e)), {}),
        "no_heads_bias": ((torch.randn(b * h, n, e), torch.randn(b * h, n, e), torch.randn(b * h, n, e)),
                          {"attn_mask": torch.randn(b * h, n, n)}),
        # a bias that also masks keys: with -inf (the masked softmax), and with finfo.min, whose sum
        # overflows to -inf although every entry is finite (the one-pass finiteness check falls back)
        "no_heads_bias_inf": ((torch.randn(b * h, n, e), torch.randn(b * h, n, e), torch.randn(b * h, n, e)),
                              {"attn_mask": _biased_mask((b * h, n, n), float("-inf"), dead_row=True)}),
        "no_heads_bias_min": ((torch.randn(b * h, n, e), torch.randn(b * h, n, e), torch.randn(b * h, n, e)),
                              {"attn_mask": _biased_mask((b * h, n, n), torch.finfo(torch.float32).min)}),
    }
    return cases


@pytest.mark.parametrize("case", list(sdpa_cases()))
@pytest.mark.parametrize("grads", [False, True])
def test_sdpa_call_equals_fused_kernel(case, grads, path):
    (q, k, v), kwargs = sdpa_cases()[case]
    module = Attend(**kwargs)
    inputs = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]
    with torch.set_grad_enabled(grads):
        want = module(*inputs)
        with vx.capture(module, attention_mode="materialize", grads=grads) as rec:
            got = module(*inputs)
        with vx.capture(module) as fused:
            module(*inputs)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.stride() == want.stride()  # the same memory layout: a model's .view() works alike
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    (record,) = rec.records
    assert record.materialized and not fused.records[0].materialized
    torch.testing.assert_close(record.probs(), fused.records[0].probs(), atol=1e-6, rtol=0)
    assert record.rows_sum_to_one == (case in ("plain", "strided", "scale", "gqa", "windows", "no_heads"))
    if grads:  # the model's gradients are the fused kernel's
        cotangent = torch.randn_like(want)
        expected = torch.autograd.grad(want, inputs, cotangent)
        for g, w in zip(torch.autograd.grad(got, inputs, cotangent), expected):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_grad_probs_equal_between_modes():
    """dy/dA from the backward pass (materialized) equals dO V^T (fused), per layer."""
    model = VisionTransformer(**TINY).eval()
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    grads = {}
    for mode in ("fused", "materialize"):
        with vx.capture(model, grads=True, attention_mode=mode) as rec:
            out = model(x)
        rec.backward(out[:, 3])
        grads[mode] = [r.grad_probs() for r in rec.records]
        assert all(r.materialized == (mode == "materialize") for r in rec.records)
    for a, b in zip(grads["fused"], grads["materialize"]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)


def _families():
    transformers = pytest.importorskip("transformers")
    torchvision = pytest.importorskip("torchvision")
    hf = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8, num_labels=3,
    ))
    tv = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=5
    )
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, add_cross_attention=True,
    ))
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)
    x, ids, memory = torch.randn(2, 3, 32, 32), torch.randint(0, 50, (2, 6)), torch.randn(2, 9, 32)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, 6:] = True  # key padding: a mask the capture must apply exactly
    return {
        "timm_vit": (VisionTransformer(**TINY), lambda m: m(x)),
        "timm_vit_registers": (VisionTransformer(**TINY, reg_tokens=2), lambda m: m(x)),
        "hf_vit_sdpa": (hf, lambda m: m(pixel_values=x).logits),
        "torchvision_vit_mha": (tv, lambda m: m(x)),
        "mha_key_padding_mask": (encoder, lambda m: m(memory, src_key_padding_mask=padding)),
        "hf_gpt2_causal_cross": (gpt2, lambda m: m(input_ids=ids, encoder_hidden_states=memory).logits),
    }


@pytest.mark.parametrize("family", ["timm_vit", "timm_vit_registers", "hf_vit_sdpa", "torchvision_vit_mha",
                                    "mha_key_padding_mask", "hf_gpt2_causal_cross"])
def test_model_outputs_equal_fused_kernel(family, path):
    model, run = _families()[family]
    model.eval()
    with torch.no_grad():
        with vx.capture(model):  # the fused kernel (MHA's C++ fast path is off in any capture)
            want = run(model)
        with vx.capture(model, attention_mode="materialize") as rec:
            got = run(model)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert rec.records and all(r.materialized for r in rec.records)


METHODS = [
    ("raw", {}), ("raw", {"head": 1, "layer": 0}), ("rollout", {}), ("rollout", {"head_fusion": "max"}),
    ("rollout", {"discard_ratio": 0.5}), ("grad_rollout", {}), ("generic", {}), ("attn_gradcam", {}), ("legrad", {}),
]


@pytest.mark.parametrize("method,options", METHODS, ids=[f"{m}{o}" for m, o in METHODS])
def test_maps_equal_between_modes(method, options, path):
    model = VisionTransformer(**TINY).eval()
    x = torch.randn(3, 3, 32, 32)
    maps = {
        mode: vx.Explainer(model, attention_mode=mode).explain(x, method=method, **options).maps
        for mode in ("fused", "materialize", "auto")
    }
    scale = float(maps["fused"].abs().max())
    for mode in ("materialize", "auto"):
        torch.testing.assert_close(maps[mode], maps["fused"], atol=1e-5 * max(scale, 1e-3), rtol=0)


class _Spy:
    """Wraps ``vx.capture`` inside the Explainer to keep each recorder it made."""

    def __init__(self, monkeypatch) -> None:
        self.recorders = []
        original = explainer_module.capture

        def spy(*args, **kwargs):
            rec = original(*args, **kwargs)
            self.recorders.append(rec)
            clear = rec.clear

            def noted_then_cleared():  # (the Explainer clears its records when its maps are made)
                self.noted.append([(r.materialized, r.heads) for r in rec.records])
                clear()

            rec.clear = noted_then_cleared
            return rec

        self.noted = []
        monkeypatch.setattr(explainer_module, "capture", spy)

    def last(self):
        return self.noted[-1]


@pytest.mark.parametrize(
    "mode,method,expected",
    [
        ("auto", "rollout", (True, "mean")),  # every layer read, no gradient: head mean kept
        ("auto", {"rollout": {"head_fusion": "max"}}, (True, "max")),
        ("auto", "generic", (False, "all")),  # gradients: the fused backward is cheaper on CPU
        ("auto", "legrad", (False, "all")),
        ("auto", ["rollout", "generic"], (False, "all")),
        ("materialize", "generic", (True, "all")),  # forced: gradients need every head
        ("auto", "raw", (False, "all")),  # one row of one layer: fused kernel + recompute
        ("auto", "attn_gradcam", (False, "all")),
        ("auto", ["raw", "rollout"], (True, "mean")),
        ("auto", {"raw": {"head": 0}, "rollout": {}}, (True, "all")),  # raw reads one head
        ("fused", "rollout", (False, "all")),  # explicit choices are respected
        ("materialize", "raw", (True, "mean")),  # raw reads the head mean only: that is what is kept
    ],
)
def test_explainer_chooses_the_mode(monkeypatch, mode, method, expected):
    model = VisionTransformer(**TINY).eval()
    spy = _Spy(monkeypatch)
    names, options = (list(method), method) if isinstance(method, dict) else (method, {})
    vx.Explainer(model, attention_mode=mode).explain(torch.randn(2, 3, 32, 32), method=names, **options)
    assert set(spy.last()) == {expected}


def test_auto_keeps_the_fused_kernel_for_large_calls():
    """One call whose probabilities exceed AUTO_CALL_BYTES runs fused (4,096-token images)."""
    side = math.isqrt(materialize.AUTO_CALL_BYTES // 4)
    module = Attend()
    for n, expected in ((side - 8, True), (side + 8, False)):
        q = torch.randn(1, 1, n, 4)
        with torch.no_grad(), vx.capture(module, attention_mode="auto") as rec:
            module(q, q, q)
        assert rec.records[0].materialized is expected


def test_auto_total_budget_and_gradients(monkeypatch):
    model = VisionTransformer(**TINY).eval()
    x = torch.randn(2, 3, 32, 32)
    per_call = 2 * 2 * 17 * 17 * 4  # B x H x N x N float32
    monkeypatch.setattr(materialize, "AUTO_TOTAL_BYTES", per_call + per_call // 2)
    with torch.no_grad(), vx.capture(model, attention_mode="auto") as rec:
        model(x)
    assert [r.materialized for r in rec.records] == [True, False]  # the second call is over the budget
    with torch.no_grad(), vx.capture(model, attention_mode="auto", heads="mean") as rec:  # H times less
        model(x)
    assert [r.materialized for r in rec.records] == [True, True]
    with vx.capture(model, attention_mode="auto", grads=True) as rec:  # gradients: the fused kernel
        model(x.requires_grad_())
    assert [r.materialized for r in rec.records] == [False, False]


def test_auto_is_fused_off_cpu_and_materialize_is_an_override():
    """A non-CPU device (meta stands in for a GPU here) keeps the fused kernel under auto."""
    model = VisionTransformer(**TINY).eval().to("meta")
    x = torch.randn(2, 3, 32, 32, device="meta")
    for mode, expected in (("auto", False), ("materialize", True)):
        with torch.no_grad(), vx.capture(model, attention_mode=mode) as rec:
            model(x)
        assert [r.materialized for r in rec.records] == [expected, expected]


def test_calls_that_cannot_be_materialized_run_fused():
    x = torch.randn(2, 3, 32, 32)
    double = VisionTransformer(**TINY).eval().double()
    with torch.no_grad(), vx.capture(double, attention_mode="materialize") as rec:
        double(x.double())
    assert not any(r.materialized for r in rec.records)
    model = VisionTransformer(**TINY, attn_drop_rate=0.5).train()  # dropout is random: fused
    with torch.no_grad(), vx.capture(model, attention_mode="materialize") as rec:
        model(x)
    assert not any(r.materialized for r in rec.records)
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), vx.capture(model, attention_mode="materialize") as rec:
        model(x)
    assert not any(r.materialized for r in rec.records)


@pytest.mark.parametrize("num_heads", [2, 1])  # (one head: the fusion is that head's probabilities, kept as they are)
def test_head_fused_records(num_heads, path):
    model = VisionTransformer(**{**TINY, "num_heads": num_heads}).eval()
    x = torch.randn(3, 3, 32, 32)  # (chunks of two images: a chunk of one at the end)
    with torch.no_grad():
        with vx.capture(model) as fused:
            model(x)
        for fusion in ("mean", "max", "min"):
            with vx.capture(model, attention_mode="materialize", heads=fusion) as rec:
                model(x)
            for record, reference in zip(rec.records, fused.records):
                assert record.heads == fusion and record.num_heads == num_heads
                torch.testing.assert_close(record.fused_probs(fusion), reference.fused_probs(fusion), atol=1e-6, rtol=0)
                torch.testing.assert_close(record.fused_probs(fusion, queries=0), reference.fused_probs(fusion)[:, :1])
                with pytest.raises(CaptureError, match=f"kept only the {fusion}"):
                    record.probs()
                other = "min" if fusion != "min" else "mean"
                if num_heads == 1:  # every fusion of one head is that head
                    torch.testing.assert_close(record.fused_probs(other), reference.fused_probs(other), atol=1e-6, rtol=0)
                    continue
                with pytest.raises(CaptureError, match=f"fused_probs\\('{fusion}'\\)"):
                    record.fused_probs(other)


def test_bad_mode_and_heads_are_usage_errors():
    model = VisionTransformer(**TINY).eval()
    with pytest.raises(UsageError, match="attention_mode must be one of"):
        vx.capture(model, attention_mode="eager")
    with pytest.raises(UsageError, match="heads must be one of"):
        vx.capture(model, heads="sum")
    with pytest.raises(UsageError, match="attention_mode must be one of"):
        vx.Explainer(model, attention_mode="flash")


def test_model_restored_after_an_exception_in_a_materializing_capture():
    model = VisionTransformer(**TINY).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        plain = model(x)
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    with pytest.raises(RuntimeError, match="boom"):
        with vx.capture(model, attention_mode="materialize", grads=True):
            model(x)
            raise RuntimeError("boom")
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == hooks
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(x), plain)  # the fused kernel again, bit for bit


def test_raw_reads_only_the_readout_rows(monkeypatch):
    """A class-token readout needs one row of the last layer, not N."""
    rows = []
    original = AttentionRecord.fused_probs

    def spy(self, fusion="mean", queries=None):
        out = original(self, fusion, queries)
        rows.append(out.shape[1])
        return out

    monkeypatch.setattr(AttentionRecord, "fused_probs", spy)
    model = VisionTransformer(**TINY).eval()
    vx.Explainer(model).explain(torch.randn(2, 3, 32, 32), method="raw")
    assert rows == [1]


def test_label_names_are_parsed_once(monkeypatch):
    from vitexplain.adapters import base

    made = []
    original = timm.data.ImageNetInfo

    class Counting(original):
        def __init__(self, *args, **kwargs):
            made.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(timm.data, "ImageNetInfo", Counting)
    base._imagenet_descriptions.cache_clear()
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1).eval()
    for _ in range(2):
        ex = vx.Explainer(model)
        for _ in range(2):
            e = ex.explain(torch.randn(1, 3, 32, 32), method="raw")
    assert len(e.label_names) == 1000 and len(made) == 1
    base._imagenet_descriptions.cache_clear()


@pytest.mark.parametrize("mode", ["fused", "materialize"])
@pytest.mark.parametrize("n_q,n_k", [(5, 0), (0, 5)])
def test_empty_query_or_key_set(mode, n_q, n_k):
    """A call with no keys (or no queries) runs as the fused kernel does (zeros) and its record is empty.

    Both used to raise a raw RuntimeError from a ``reshape(-1, ...)`` of zero elements: at
    ``probs()`` (fused), and inside the model's own forward when materializing.
    """
    module = Attend()
    q, k, v = torch.randn(2, 3, n_q, 4), torch.randn(2, 3, n_k, 4), torch.randn(2, 3, n_k, 4)
    want = module(q, k, v)
    with vx.capture(module, attention_mode=mode) as rec:
        got = module(q, k, v)
    assert torch.equal(got, want)
    (record,) = rec.records
    assert record.probs().shape == (2, 3, n_q, n_k)


def test_a_one_head_record_kept_fused_gives_every_fusion():
    # a materialised one-head call kept fused (heads="mean") refused fused_probs("max") as having no heads kept;
    # the max, min and mean of one head are that head: each equals the softmax written out
    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    q, k, v = torch.randn(3, 2, 1, 5, 8, generator=torch.Generator().manual_seed(3)).unbind(0)
    with torch.no_grad(), vx.capture(Attend(), attention_mode="materialize", heads="mean") as rec:
        rec.model(q, k, v)
    expected = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1)[:, 0]
    for fusion in ("mean", "max", "min"):
        torch.testing.assert_close(rec.records[0].fused_probs(fusion), expected, rtol=1e-5, atol=1e-6)
