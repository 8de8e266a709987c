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
    with torch.no_grad():
        model.bias.add_(torch.randn(2, 15))  # e.g. an optimizer step before the records are read
    with pytest.raises(vx.CaptureError, match="written in place after the call"):
        rec.records[0].probs()
    model.bias = nn.Parameter(torch.randn(2, 15))  # a new tensor under the same name
    with pytest.raises(vx.CaptureError, match=r"_RelBias\.bias.*changed after the call"):
        rec.records[0].probs()
