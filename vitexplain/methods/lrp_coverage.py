"""What the LRP rules do not cover: the calls :class:`~vitexplain.methods.lrp_rules.LRPRules` records as
uncovered while the forward runs, and the errors raised instead of maps that are not LRP relevance.

A softmax that is not attention's (recognised by the rules themselves), a log-softmax or logsumexp (a
log-probability target: LRP explains the logit), an element-wise exponential, logarithm, power, square, root,
trigonometric function, variance or division by an activation (a norm written out in Python), in place or not
(``x.exp_()``, ``x /= n``), a product of two activations fused with an addition (``baddbmm``, ``addcmul``) or of
several in one call (``prod``, ``glu``), a recurrent cell, a BatchNorm with batch statistics or FlexAttention is not covered:
:func:`uncovered_call` names such a call, :class:`~vitexplain.methods.lrp_rules.LRPRules` counts it and
:func:`check_coverage` raises after the forward. :func:`checkpointing_refused` turns the error of a backward that
recomputes checkpointed blocks (outside the rules' reach) into one that says what to do. Sources: docs/methods.md
("AttnLRP and CP-LRP").
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from ..errors import UnsupportedModelError

__all__ = ["uncovered_call", "check_coverage", "checkpointing_refused", "flex_refused"]

#: Products fused with an addition in one call (``beta * input + alpha * (a @ b)``).
FUSED_PRODUCTS = {getattr(o, n) for o in (torch, torch.Tensor) for n in
                  ("addmm", "baddbmm", "addbmm", "addmv", "addr", "addcmul", "addmm_", "baddbmm_", "addbmm_", "addmv_",
                   "addr_", "addcmul_") if hasattr(o, n)}
#: Products of several activations inside one call (the uniform rule needs each factor as an operand of its own).
PRODUCTS_IN_ONE_CALL = {getattr(o, n) for o in (torch, torch.Tensor) for n in ("prod", "cumprod", "cumprod_")
                        if hasattr(o, n)} | {F.glu}
#: Element-wise non-linear calls no rule covers (written-out norms, exponentials): refused on an activation.
#: Their in-place spellings (``x.exp_()``, ``x /= n``, ``x **= 2``) and torch.special's aliases are the same calls.
_NONLINEAR_NAMES = ("exp", "exp2", "log", "sqrt", "rsqrt", "erf", "erfc", "reciprocal", "log1p", "expm1", "log2", "log10",
                    "pow", "float_power", "div", "divide", "true_divide", "square", "sin", "cos", "tan", "asin", "acos",
                    "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "var", "std", "var_mean", "std_mean", "addcdiv")
NONLINEAR = {getattr(o, n + suffix) for o in (torch, torch.Tensor) for n in _NONLINEAR_NAMES for suffix in ("", "_")
             if hasattr(o, n + suffix)}
NONLINEAR |= {getattr(torch.special, n) for n in ("exp2", "expm1", "erf", "erfc", "log1p") if hasattr(torch.special, n)}
NONLINEAR |= {torch.Tensor.__pow__, torch.Tensor.__rpow__, torch.Tensor.__ipow__, torch.Tensor.__truediv__,
              torch.Tensor.__rtruediv__, torch.Tensor.__itruediv__, torch.Tensor.__div__, torch.Tensor.__rdiv__,
              torch.Tensor.__idiv__}
LOG_SOFTMAX = {torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax, torch.special.log_softmax,
               torch.logsumexp, torch.Tensor.logsumexp, torch.special.logsumexp}
#: Recurrent cells: their gates multiply activations inside one fused call no rule can reach.
RECURRENT = {getattr(torch, n) for n in ("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "lstm", "gru",
                                         "rnn_tanh", "rnn_relu") if hasattr(torch, n)}


def uncovered_call(func: Callable, args: tuple, kwargs: dict, live: Callable[[Any], bool]) -> Optional[str]:
    """What a torch call no rule covers does (for the refusal's message), or None when the call is not one.

    Args:
        func, args, kwargs: the call, as a torch function mode receives it (after the rules' own calls).
        live: whether a tensor is an activation (:meth:`LRPRules._live <vitexplain.methods.lrp_rules.LRPRules>`).
    """
    if func in FUSED_PRODUCTS and len(args) >= 3 and live(args[1]) and live(args[2]):
        fused = getattr(func, "__name__", func)
        return f"{fused} (a fused multiply-add of two activations)"
    if func in PRODUCTS_IN_ONE_CALL and args and live(args[0]):
        return f"{getattr(func, '__name__', func)} of an activation (a product of several activations in one call)"
    if func in NONLINEAR and _nonlinear_on_activation(func, args, live):
        return f"{getattr(func, '__name__', func)} of an activation"
    if func in LOG_SOFTMAX and args and live(args[0]):
        name = getattr(func, "__name__", "log_softmax")
        return f"{name} (a log-probability: explain the logit)"
    if func in RECURRENT:
        return "a recurrent cell (LSTM/GRU)"
    if func is F.batch_norm and _batch_statistics(args, kwargs, live):
        return "batch_norm with batch statistics (a model in training mode: call model.eval())"
    if getattr(func, "__name__", "") in ("flex_attention", "flex_attention_hop"):
        return "FlexAttention"
    return None


def flex_refused(variant: str) -> UnsupportedModelError:
    """The error for a model that calls FlexAttention under the LRP rules (raised at the call, by
    :class:`~vitexplain.methods.lrp_rules.LRPRules`, which sees the torch calls of ``flex_attention``'s own frame):
    no rule covers its fused kernel, and on the CPU torch would fail first, with a bare ``NotImplementedError``
    (FlexAttention has no backward there).

    Args:
        variant: the rules' variant, ``"attnlrp"`` or ``"cp"``.
    """
    method = "cp_lrp" if variant == "cp" else variant
    return UnsupportedModelError(
        f"method {method!r}: the model calls FlexAttention, which the LRP rules do not cover, so its maps would not be "
        "LRP relevance; use 'generic' or 'integrated_gradients' (on a CUDA device: FlexAttention has no backward on "
        "CPU), or 'rollout' or 'occlusion'"
    )


def _batch_statistics(args: tuple, kwargs: dict, live: Callable[[Any], bool]) -> bool:
    """Whether an ``F.batch_norm`` call of an activation normalises by its batch's statistics (``training=True``:
    a model in training mode, or no running statistics): the images' relevance would mix, and the norm is not
    the affine map it is with running statistics (which keeps its gradient: a linear map)."""
    training = kwargs.get("training", args[5] if len(args) > 5 else False)
    return bool(training) and bool(args) and live(args[0])


def _nonlinear_on_activation(func: Callable, args: tuple, live: Callable[[Any], bool]) -> bool:
    """Whether an element-wise non-linear call (:data:`NONLINEAR`) reaches an activation: its input, a power's
    base (exponent not 1) or exponent, or a division's divisor is live (a division by a constant is linear)."""
    if not args:
        return False
    # the spellings of one call: x.div_(y), x /= y (``__itruediv__``), y.__rtruediv__(2), torch.divide(x, y), ...
    name = getattr(func, "__name__", "").strip("_").removeprefix("i")
    name = {"truediv": "div", "divide": "div", "true_divide": "div", "rtruediv": "rdiv", "float_power": "pow"}.get(name, name)
    if name == "div":  # (x / y, x.div_(y), x /= y)
        return len(args) > 1 and live(args[1])
    if name == "addcdiv":  # input + value * t1 / t2: t2 is the divisor
        return len(args) > 2 and live(args[2])
    if name == "rdiv":  # number / tensor: the tensor is the divisor
        return live(args[0])
    if name in ("pow", "rpow"):
        base, exponent = args[0], args[1] if len(args) > 1 else None
        if name == "rpow":
            return live(base)
        linear = isinstance(exponent, (int, float)) and exponent == 1
        return live(exponent) or (live(base) and not linear)
    return live(args[0])

@contextlib.contextmanager
def checkpointing_refused(method: str, model: str) -> Iterator[None]:
    """Around the relevance's backward: gradient checkpointing recomputes blocks there, outside the rules (a torch
    function mode does not reach the recompute), and torch raises its own error; raise one that says what to do.

    Raises:
        UnsupportedModelError: the backward hit a checkpointed block.
    """
    try:
        yield
    except RuntimeError as err:
        if "checkpoint" not in str(err):
            raise
        raise UnsupportedModelError(
            f"method {method!r}: {model} recomputes its blocks in the backward (gradient checkpointing), where the LRP "
            "rules do not reach; turn it off while explaining (timm: model.set_grad_checkpointing(False); "
            "transformers: model.gradient_checkpointing_disable())"
        ) from err


def check_coverage(rules: Any, method: str, model: str, *, attention: bool = True,
                   instead: Optional[str] = None) -> None:
    """Raise when the forward held a non-linearity no rule covers, or (``attention``) no attention at all.

    Args:
        rules: the :class:`~vitexplain.methods.lrp_rules.LRPRules` the forward ran under (its ``seen``).
        instead: the methods of the model's family the message suggests (a captioner's or a vision-language
            model's are not the image classifiers'; None: theirs).

    Raises:
        UnsupportedModelError: the relevance would not be LRP's (the message says what to do).
    """
    uncovered = sorted(set(rules.seen["uncovered"]))
    if uncovered:
        raise UnsupportedModelError(
            f"method {method!r}: {model}'s forward calls {', '.join(uncovered)}, which the LRP rules do not cover, "
            f"so its maps would not be LRP relevance; use {instead or repr('generic') + ' or ' + repr('integrated_gradients')}"
        )
    if attention and rules.seen["attention"] == 0:
        raise UnsupportedModelError(
            f"method {method!r}: {model} made no attention call (scaled_dot_product_attention, nn.MultiheadAttention "
            f"or a softmax over attention scores) during its forward, so the attention rules could not be applied; use "
            f"{instead or repr('integrated_gradients') + ' or ' + repr('smoothgrad')}"
        )
