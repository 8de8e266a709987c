"""Gradients of a capture's records: :meth:`Recorder.backward`'s own autograd pass to every record, and the
process-wide count of such passes, during which no record's gradient hook collects (a capture nested in another,
e.g. an explainer's inside a user's, sees the same graph; each pass reaches the records it targets only)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch import Tensor

from ..errors import CaptureError, InputError

__all__ = ["hooks_paused", "backward_running", "backward_pass", "zero_grads"]

#: how many :meth:`Recorder.backward` passes run now (any recorder): no record's hook collects meanwhile
_BACKWARDS = [0]
_BACKWARDS_LOCK = threading.Lock()


@contextlib.contextmanager
def hooks_paused() -> Iterator[None]:
    """Inside, no recorder's gradient hooks collect (as while a recorder's own :meth:`Recorder.backward`
    runs): for a method's own autograd pass over a captured graph once its records hold their
    gradients (LeGrad differentiates each layer's score; the capture's hooks on the attention
    outputs added those gradients to the records, and a method run after it read them)."""
    with _BACKWARDS_LOCK:
        _BACKWARDS[0] += 1
    try:
        yield
    finally:
        with _BACKWARDS_LOCK:
            _BACKWARDS[0] -= 1


def backward_running() -> bool:
    """Whether a :meth:`Recorder.backward` pass (of any recorder) or a :func:`hooks_paused` block runs now."""
    return _BACKWARDS[0] != 0


def backward_pass(recorder: Any, score: Tensor, retain_graph: bool) -> None:
    """:meth:`Recorder.backward` (see its docstring): ``score`` back to every record and activation of ``recorder``,
    accumulated into them; no recorder's gradient hook collects meanwhile."""
    if not recorder.grads:
        raise CaptureError("gradients were not captured: use vx.capture(model, grads=True)")
    if not isinstance(score, Tensor) or not score.is_floating_point():
        what = f"a {score.dtype} tensor" if isinstance(score, Tensor) else type(score).__name__
        raise InputError(f"rec.backward expects a float tensor computed from the model outputs, got {what}")
    targets: list[tuple[Any, Tensor]] = [(r, r._out) for r in recorder._records if r._out is not None]
    targets += [(a, a.output) for calls in recorder.activations.values() for a in calls if a.output.requires_grad]
    if not targets:
        raise CaptureError(
            "nothing captured is part of an autograd graph (the forward ran under torch.no_grad(), or "
            "neither the input nor any parameter requires grad)"
        )
    if not score.requires_grad:
        raise CaptureError(
            "the score given to rec.backward is not part of an autograd graph: compute it from the outputs "
            "of the captured forward, run with gradients enabled (not under torch.no_grad())"
        )
    try:
        with hooks_paused():
            grads = torch.autograd.grad(
                score.sum(), [t for _, t in targets], retain_graph=retain_graph, allow_unused=True
            )
    except RuntimeError as error:
        if "second time" not in str(error):
            raise
        raise CaptureError(
            "the autograd graph of this forward was freed by an earlier backward: pass retain_graph=True to "
            "every rec.backward(...) on it but the last, or run the forward again"
        ) from error
    for (obj, tensor), grad in zip(targets, grads):
        obj._add_grad(grad if grad is not None else torch.zeros_like(tensor))


def zero_grads(recorder: Any) -> None:
    """:meth:`Recorder.zero_grad`: forget the gradients of every record and activation of ``recorder``."""
    for record in recorder._records:
        record._grad_out = record._grad_probs = None
    for calls in recorder.activations.values():
        for call in calls:
            call.grad = None
