"""What a capture records of the modules it is asked for (``vx.capture(model, activations=[...])``):
each call's input and output (:class:`ActivationRecord`), and the
gradient that reaches the output: the layers the Grad-CAM family and the token methods read.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import Tensor, nn

from .records import weak_grad_hook
from .sink import Issuer, in_backward

__all__ = ["ActivationRecord", "activation_hook"]


@dataclass(eq=False)
class ActivationRecord:
    """Input and output of one module call, with the output's gradient when captured.

    Attributes:
        name: module path.
        step: call count of this module within the capture (0 first).
        forward_index: the top-level call it belongs to, as ``AttentionRecord.forward_index``.
        input: the first tensor argument the module received (a reference).
        output: the module's output tensor (a reference, still in the autograd graph).
        grad: gradient of the backpropagated score w.r.t. ``output``, once a backward ran.
        args: all positional arguments of the call (references), so that a method can
            call the module again the way the model did (e.g. a block's position bias).
        kwargs: its keyword arguments (references).
        tuple_output: the module returned a tuple or list, whose first tensor is ``output``.
    """

    name: str
    step: int
    input: Optional[Tensor]
    output: Tensor
    grad: Optional[Tensor] = None
    args: tuple = field(default=(), repr=False)
    kwargs: dict = field(default_factory=dict, repr=False)
    tuple_output: bool = False
    forward_index: int = 0

    def _add_grad(self, grad: Tensor) -> None:
        grad = grad.detach()
        self.grad = grad if self.grad is None else self.grad + grad


def activation_hook(rec: Any, name: str) -> Callable:
    """The forward hook (``with_kwargs=True``) that records each call of the module ``name`` into
    ``rec.activations[name]`` (an :class:`ActivationRecord`), with a gradient hook when ``rec`` takes
    gradients, and hands a copy of the output on to the model (:func:`_handed_on`).

    Args:
        rec: the :class:`~vitexplain.recording.recorder.Recorder` of the capture.
        name: the module's name in the model.
    """
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        out = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(out, Tensor) or in_backward():  # (a checkpointed forward recomputed: seen before)
            return
        if not rec.in_scope_thread():  # another thread's call of the model: not the capture's
            return
        inp = next((a for a in args if isinstance(a, Tensor)), None)
        record = ActivationRecord(
            name=name, step=len(rec.activations[name]), input=inp, output=out, args=args,
            kwargs=dict(kwargs), tuple_output=out is not output,
            forward_index=rec._attribution.forward_index(Issuer(name, module, sys._getframe())),
        )
        if rec.grads and out.requires_grad:
            out.register_hook(weak_grad_hook(record, rec.hooks_enabled))
        rec.activations[name].append(record)
        return _handed_on(output, out)

    return hook


def _handed_on(output: Any, out: Tensor) -> Any:
    """What a recorded module hands on to the model: ``output`` with its tensor ``out`` replaced
    by a copy (plain tuples and lists rebuilt), or None (unchanged) for other containers.

    The record keeps ``out`` as the module returned it: a model that changes the output in place
    afterwards (DenseNet's ``F.relu(features, inplace=True)``, a ResNet block's ``out += identity``
    after ``bn2``) changes the copy, so the recorded values and the gradient taken with respect to
    them are the module's (they were the in-place result's, and Grad-CAM on ``bn2`` mixed the two).
    The copy is an autograd ``clone``: values and gradients downstream are unchanged.
    """
    if output is out:
        return out.clone()
    if type(output) in (tuple, list):
        return type(output)(out.clone() if item is out else item for item in output)
    return None
