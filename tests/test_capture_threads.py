"""``hooks_paused`` pauses the gradient hooks of the passes its own thread runs, never another thread's capture.

On CUDA a backward pass runs on autograd's device threads, which Python did not start (``threading`` sees a
``_DummyThread`` there), so a record's gradient hook cannot tell from the thread it runs on which Python thread's
pass it serves. Such hooks used to pause while *any* thread was inside ``hooks_paused`` (the Explainer runs every
method inside it): a capture's backward in another thread then got no gradient, or part of it when it accumulated
several. The hooks of a thread Python did not start are exercised here on CPU by running the other capture in a
thread started with ``_thread.start_new_thread``, which ``threading`` also sees as a ``_DummyThread``.
Oracle: ``dy/dA = dO V^T`` written out from the cotangent and the values.
"""

from __future__ import annotations

import _thread
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitexplain as vx
from vitexplain.recording import hooks_paused

pytestmark = pytest.mark.usefixtures("one_thread")


class _Attend(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def _capture_and_backward(result: dict, passes: int) -> None:
    """A capture with gradients, ``passes`` backward passes of the user's (accumulated), and dy/dA (or the error)."""
    try:
        result["foreign"] = isinstance(threading.current_thread(), threading._DummyThread)
        q, k, v = torch.randn(2, 3, 5, 4, requires_grad=True), torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
        module = _Attend()
        with vx.capture(module, grads=True) as rec:
            out = module(q, k, v)
        cotangent = torch.randn_like(out)
        for _ in range(passes):
            (out * cotangent).sum().backward(retain_graph=True)
        result["got"] = rec.records[0].grad_probs().double()
        result["want"] = passes * cotangent.double() @ v.double().transpose(-2, -1)
    except BaseException as error:  # (reported by the caller)
        result["error"] = error


@pytest.mark.parametrize("passes", [1, 2])
def test_a_paused_thread_does_not_pause_a_capture_whose_hooks_run_on_a_thread_python_did_not_start(passes):
    result: dict = {}
    done = threading.Event()

    def run() -> None:
        _capture_and_backward(result, passes)
        done.set()

    with hooks_paused():
        _thread.start_new_thread(run, ())
        assert done.wait(60)
    assert result.get("foreign") is True  # (the capture ran where CUDA hooks run: a thread Python did not start)
    assert "error" not in result, result.get("error")
    torch.testing.assert_close(result["got"], result["want"], atol=1e-5, rtol=1e-5)


def test_the_paused_threads_own_passes_add_nothing_and_run_on_it():
    """Inside hooks_paused this thread's backward passes add nothing to any record (a method's own pass over a
    captured graph); they run on this thread (multithreaded backward off inside, as found after), which is what
    lets a hook tell them on CUDA too. Outside, the same pass adds dO V^T."""
    q, k, v = torch.randn(1, 2, 4, 4, requires_grad=True), torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
    module = _Attend()
    with vx.capture(module, grads=True) as rec:
        out = module(q, k, v)
    cotangent = torch.randn_like(out)
    found = torch._C._is_multithreading_enabled()
    with hooks_paused():
        assert not torch._C._is_multithreading_enabled()
        (out * cotangent).sum().backward(retain_graph=True)
    assert torch._C._is_multithreading_enabled() == found
    with pytest.raises(vx.CaptureError, match="no gradient has reached"):
        rec.records[0].grad_probs()
    (out * cotangent).sum().backward()
    want = cotangent.double() @ v.double().transpose(-2, -1)
    torch.testing.assert_close(rec.records[0].grad_probs().double(), want, atol=1e-5, rtol=1e-5)
