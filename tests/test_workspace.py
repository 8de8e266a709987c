"""The buffers a materialising capture reuses between captures of one model (vitexplain/recording/workspace.py):
lent only when nothing else holds them, so attention a caller kept is never overwritten."""

import threading

import pytest
import torch

import vitexplain as vx
from vitexplain.recording import workspace


@pytest.fixture(scope="module")
def model():
    return vx.zoo.load("shapes-hier").eval()


def _capture(model, x):
    with torch.no_grad(), vx.capture(model, attention_mode="materialize") as rec:
        model(x)
    return rec


def _storages(rec):
    return {r.probs().untyped_storage().data_ptr() for r in rec.records}


def test_records_a_caller_keeps_are_not_overwritten_by_the_next_capture(model):
    x = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    kept = _capture(model, x)
    want = [r.probs().clone() for r in kept.records]
    later = _capture(model, torch.flip(x, dims=(-1,)))  # other attention, computed while the first is held
    assert not _storages(kept) & _storages(later)
    for r, w in zip(kept.records, want):
        assert torch.equal(r.probs(), w)


def test_buffers_are_reused_once_released(model):
    if workspace._COUNT is None:
        pytest.skip("this torch does not expose a storage's use count: nothing is pooled")
    x = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    first = _capture(model, x)
    chunked = _storages(first) & {b.untyped_storage().data_ptr() for b in workspace.workspace_for(model)._buffers}
    assert chunked  # (the chunked path took its probabilities from the workspace)
    first.clear()
    second = _capture(model, x)
    assert chunked <= _storages(second)  # the released buffers again, not new pages
    # the maps of an explanation that reused them equal those computed without a workspace
    ex = vx.Explainer(model)
    a = ex.explain(x, method="rollout").maps
    workspace_count, workspace._COUNT = workspace._COUNT, None
    try:
        b = ex.explain(x, method="rollout").maps
    finally:
        workspace._COUNT = workspace_count
    assert torch.equal(a, b)


def test_two_threads_capturing_one_model_get_their_own_attention(model):
    xs = [torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    want = [[r.probs().clone() for r in _capture(model, x).records] for x in xs]
    got: dict[int, list] = {}
    errors = []

    def run(i):
        try:
            for _ in range(3):
                rec = _capture(model, xs[i])
                got[i] = [r.probs().clone() for r in rec.records]
                rec.clear()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(2):
        for g, w in zip(got[i], want[i]):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
