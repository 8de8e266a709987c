"""Show, Attend and Tell (zoo ``shapes-sat``): per-word maps are the decoder's own additive attention.

Oracles: the weights the model's decoder returns (``run_decoder``), and for ``cross_generic``
the gradient of each word's log-probability w.r.t. its step's weights, from ``retain_grad`` in a
decoding loop written out in the test.
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
from vitexplain.zoo.models import caption_words
from vitexplain.zoo.sat import ShowAttendTell, doubly_stochastic


@pytest.fixture(scope="module")
def sat() -> ShowAttendTell:
    torch.manual_seed(0)
    m = ShowAttendTell(caption_words()).eval()
    with torch.no_grad():  # sharper attention and a longer caption than a random init gives
        m.attention.v.weight.mul_(20.0)
        m.out.bias[m.vocab.eos_id] = -5.0
    return m


def test_cross_maps_are_the_decoder_weights_generated_or_teacher_forced(sat):
    x = torch.randn(3, 3, 64, 64)
    ex = vx.Explainer(sat)
    assert ex.family == "caption" and ex.methods() == ["cross", "cross_generic"]
    generated = ex.explain_caption(x, method="cross", max_len=5)
    ids = generated.ids
    t = ids.shape[1]
    assert generated.maps.shape == (3, t, 16, 16) and t >= 2  # stride-4 grid
    forced = ex.explain_caption(x, method="cross", caption=ids.tolist())
    torch.testing.assert_close(generated.maps, forced.maps, atol=1e-6, rtol=0)
    with torch.no_grad():
        own, _ = sat.generate(x, max_len=5)
        _, alphas = sat.run_decoder(sat.encode(x), torch.cat([torch.full_like(ids[:, :1], 1), ids[:, :-1]], 1))
    assert torch.equal(ids, own[:, :t])
    for i, words in enumerate(forced.tokens):
        n = len(words)
        torch.testing.assert_close(forced.maps[i, :n].reshape(n, 256), alphas[i, :n], atol=1e-6, rtol=0)
    with vx.capture(sat) as rec, torch.no_grad():
        sat(x, torch.ones(3, 3, dtype=torch.long))  # teacher-forced: one attention call per step
    assert rec.layout == vx.TokenLayout(0, (16, 16), False, "mean", patch_size=(4, 4))
    assert [r.step for r in rec.records] == list(range(len(rec.records))) and rec.records[0].kind == "cross"


def test_cross_generic_is_each_words_gradient_weighted_attention(sat):
    x = torch.randn(2, 3, 64, 64)
    ex = vx.Explainer(sat)
    generic = ex.explain_caption(x, method="cross_generic", caption="red circle and blue star")
    ids = torch.tensor([sat.vocab.encode("red circle and blue star") + [sat.vocab.eos_id]] * 2)
    annotations = sat.encode(x.clone().requires_grad_(True))
    state = sat.init_state(annotations)
    token = torch.full((2,), sat.vocab.bos_id)
    kept, logits = [], []
    for t in range(ids.shape[1]):
        step_logits, state, alpha = sat.step(token, annotations, state)
        alpha.retain_grad()
        kept.append(alpha)
        logits.append(step_logits)
        token = ids[:, t]
    for t in range(5):
        for a in kept:
            a.grad = None
        logp = torch.log_softmax(logits[t], -1).gather(1, ids[:, t : t + 1]).sum()
        logp.backward(retain_graph=True)
        expected = (kept[t].grad * kept[t].detach()).clamp(min=0)
        torch.testing.assert_close(generic.maps[:, t].reshape(2, 256), expected, atol=1e-6, rtol=1e-5)


def test_doubly_stochastic_penalty_matches_the_formula():
    alphas = torch.softmax(torch.randn(2, 4, 6), -1)
    steps = torch.tensor([[True, True, True, False], [True, True, True, True]])
    expected = torch.stack([((1 - alphas[b, : 3 + b].sum(0)) ** 2).sum() for b in range(2)])
    torch.testing.assert_close(doubly_stochastic(alphas, steps), expected)


def test_caption_command_runs_shapes_sat(tmp_path):
    """``vitexplain caption --model shapes-sat``: the zoo name is enough, no CLI change."""
    import json
    from pathlib import Path

    from vitexplain.cli import main

    sample = Path(__file__).resolve().parent.parent / "assets" / "samples" / "03_green_cross_and_red_circle.png"
    assert main(["caption", str(sample), "--out", str(tmp_path), "--model", "shapes-sat", "-q", "-j", "0"]) == 0
    written = json.loads((tmp_path / f"{sample.name}.caption.json").read_text())
    assert written["caption"] == "green cross and red circle"
    assert (tmp_path / f"{sample.name}.cross.png").is_file()
