"""The activation modules of the explained model under the LRP rules: their forward hooks, scoped to the rules.

An element-wise activation written as a module (transformers' and timm's, some in Python arithmetic, e.g. GPT-2's
``NewGELUActivation``), an RMSNorm module written out in Python and MetaFormer's ``StarReLU`` get their rule as a whole
(:func:`~vitexplain.methods.lrp_ops.activation_module`): while such a module runs on one tensor, the torch calls inside
it get no rule, and its output is replaced by the rule's (:class:`~vitexplain.methods.lrp_ops.ActivationModuleRule`:
the gradient ``out / x``). A module that works in place runs on a copy of its input (the rule reads the input's values
and autograd node), and the rule's output is written back into the input, as the module would have; one that
overwrites its input without saying so is not covered. Sources: docs/methods.md ("AttnLRP and CP-LRP").
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .lrp_ops import ActivationModuleRule, activation_module, star_relu_rule

__all__ = ["ActivationModuleHooks"]


class ActivationModuleHooks:
    """The module hooks of :class:`~vitexplain.methods.lrp_rules.LRPRules` (a mixin: the rules' ``model``, ``seen``,
    ``_thread``, ``_inside`` (> 0 while a module runs whole), ``_calls`` and ``_handles`` are its state)."""

    model: Optional[nn.Module]
    seen: dict[str, Any]
    _thread: int
    _inside: int
    _calls: list[Optional[tuple[Tensor, int, Optional[Tensor]]]]
    _handles: list[Any]

    def _hook_modules(self) -> None:
        """Hooks on the activation modules of ``model`` (none without a model); removed by :meth:`_remove_hooks`."""
        if self.model is None:
            return
        try:
            for module in self.model.modules():
                kind = activation_module(module)
                if kind:
                    self._handles.append(module.register_forward_pre_hook(self._enter_activation, with_kwargs=True))
                    self._handles.append(module.register_forward_hook(
                        lambda m, i, o, kind=kind: self._leave_activation(m, i, o, kind), always_call=True))
        except BaseException:
            self._remove_hooks()
            raise

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._inside = 0
        self._calls = []

    def _enter_activation(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """A call of one tensor (an element-wise function of it) gets the module's rule: the calls inside run
        without rules. Any other call (a gated norm's second input) runs under the rules, call by call.

        A module that works in place (timm's ``Sigmoid(inplace=True)``, ``Swish(inplace=True)``: ``x.sigmoid_()``,
        ``x.mul_(x.sigmoid())``) would overwrite its input, whose values (the rule's denominator) and autograd node
        (where the rule's gradient goes) the rule needs: it runs on a clone, and :meth:`_leave_activation` writes the
        rule's output back into the input, as the module would have."""
        if threading.get_ident() != self._thread:
            return None
        tensors_in_kwargs = any(isinstance(v, Tensor) for v in kwargs.values())
        whole = len(args) == 1 and isinstance(args[0], Tensor) and not tensors_in_kwargs
        if not whole:
            self._calls.append(None)
            return None
        x = args[0]
        in_place = getattr(module, "inplace", False) is True and x.requires_grad and torch.is_grad_enabled()
        clone = x.clone() if in_place else None
        self._calls.append((x, x._version, clone))
        self._inside += 1
        return None if clone is None else ((clone,), kwargs)

    def _leave_activation(self, module: nn.Module, inputs: tuple, output: Any, kind: str = "activation") -> Any:
        """The module's output replaced by its rule's (``kind``: ``"activation"``, ``"norm"`` or ``"star_relu"``);
        None (the output as it is) for a call run under the rules call by call, or outside a gradient."""
        if threading.get_ident() != self._thread or not self._calls:
            return None
        call = self._calls.pop()
        if call is None:
            return None
        self._inside = max(0, self._inside - 1)
        x, version, clone = call
        if not (x.requires_grad and torch.is_grad_enabled()):
            return None
        if not (isinstance(output, Tensor) and output.shape == x.shape):
            self.seen["uncovered"].append(f"{type(module).__name__} (its output is not element-wise in its input)")
            return None
        if x._version != version:  # changed in place by a module without an ``inplace`` flag: its input is lost
            self.seen["uncovered"].append(f"{type(module).__name__} (it overwrites its input in place)")
            return None
        if kind == "star_relu":
            self.seen["activation"] += 1
            out = star_relu_rule(module, x)
        else:
            self.seen[kind] += 1
            out = ActivationModuleRule.apply(x, output, kind == "norm")
        in_place = clone is not None and (output is clone or clone._version != 0)
        return x.copy_(out) if in_place else out
