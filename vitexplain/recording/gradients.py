"""Gradients of a capture's records: :meth:`Recorder.backward`'s own autograd pass to every record, and the passes
during which no record's gradient hook collects: those passes (known by their autograd graph task; a capture nested
in another, e.g. an explainer's inside a user's, sees the same graph, and each pass reaches the records it targets
only) and the passes a thread runs inside :func:`hooks_paused` (run on that thread, so that a thread-local count
tells them). Other threads' passes are not affected."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch import Tensor

from ..errors import CaptureError, InputError

__all__ = ["hooks_paused", "backward_running", "backward_pass", "zero_grads"]

_BACKWARDS_LOCK = threading.Lock()
_local = threading.local()  # .paused: how many hooks_paused blocks are open in this thread
#: the autograd graph tasks of the Recorder.backward passes running now (torch._C._current_graph_task_id)
_PASSES: set[int] = set()
_task = getattr(torch._C, "_current_graph_task_id", None)


@contextlib.contextmanager
def hooks_paused() -> Iterator[None]:
    """Inside, no recorder's gradient hooks collect in the backward passes this thread runs (as in a
    recorder's own :meth:`Recorder.backward`): for a method's own autograd pass over a captured graph once its
    records hold their gradients (LeGrad differentiates each layer's score; the capture's hooks on the attention
    outputs added those gradients to the records, and a method run after it read them).

    Those passes run on this thread (``torch.autograd.set_multithreading_enabled(False)``, thread-local: CUDA
    passes otherwise run on autograd's device threads, where a hook cannot tell which thread's pass it serves), so
    the hooks tell them by a count kept for this thread. Passes of other threads are never paused, also those whose
    hooks run on autograd's device threads (a capture's backward on CUDA in another thread): they used to pause
    while any thread was inside such a block, and lost their gradients."""
    with torch.autograd.set_multithreading_enabled(False):
        _local.paused = getattr(_local, "paused", 0) + 1
        try:
            yield
        finally:
            _local.paused -= 1


def backward_running() -> bool:
    """Whether the backward pass running now is a :meth:`Recorder.backward` pass (of any recorder) or one run
    inside a :func:`hooks_paused` block (on its own thread, see there): then no record's gradient hook collects."""
    if _PASSES and _task is not None and _task() in _PASSES:
        return True
    return bool(getattr(_local, "paused", 0))


def _own_pass(root: Tensor, passes: list[int]) -> None:
    """Mark the backward pass from ``root`` as a Recorder.backward pass as it starts: a hook on ``root`` runs
    first in it and notes its graph task (``passes`` keeps it to forget afterwards)."""

    def mark(grad: Tensor) -> None:
        if _task is not None:
            task = _task()
            with _BACKWARDS_LOCK:
                _PASSES.add(task)
            passes.append(task)

    root.register_hook(mark)


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
        for record in recorder._records:  # a record that knows why (an extractor's weights outside the graph)
            if record._grad_state in ("not_in_graph", "no_output"):
                record._check_grads(need_backward=False)
        raise CaptureError(
            "nothing captured is part of an autograd graph (the forward ran under torch.no_grad(), or "
            "neither the input nor any parameter requires grad)"
        )
    if not score.requires_grad:
        raise CaptureError(
            "the score given to rec.backward is not part of an autograd graph: compute it from the outputs "
            "of the captured forward, run with gradients enabled (not under torch.no_grad())"
        )
    root = score.sum()
    passes: list[int] = []
    if _task is not None:
        _own_pass(root, passes)
    try:
        with contextlib.ExitStack() as stack:
            if _task is None:  # (no graph task ids in this torch: every pass pauses, as hooks_paused does)
                stack.enter_context(hooks_paused())
            grads = torch.autograd.grad(root, [t for _, t in targets], retain_graph=retain_graph, allow_unused=True)
    except RuntimeError as error:
        if "second time" not in str(error):
            raise
        raise CaptureError(
            "the autograd graph of this forward was freed by an earlier backward: pass retain_graph=True to "
            "every rec.backward(...) on it but the last, or run the forward again"
        ) from error
    finally:
        with _BACKWARDS_LOCK:
            _PASSES.difference_update(passes)
    for (obj, tensor), grad in zip(targets, grads):
        obj._add_grad(grad if grad is not None else torch.zeros_like(tensor))


def zero_grads(recorder: Any) -> None:
    """:meth:`Recorder.zero_grad`: forget the gradients of every record and activation of ``recorder``."""
    for record in recorder._records:
        record._grad_out = record._grad_probs = None
    for calls in recorder.activations.values():
        for call in calls:
            call.grad = None
