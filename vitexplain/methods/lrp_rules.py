"""LRP rules for transformers as a scoped torch function mode: AttnLRP and CP-LRP on the unchanged model.

LRP in the Gradient x Input framework (Achtibat et al., "AttnLRP", ICML 2024, section 3.3): the
model's forward is run with some operations' *gradients* changed, then ``x * dy/dx`` at the
input is the relevance. :class:`LRPRules` is a :class:`~torch.overrides.TorchFunctionMode` (the
mechanism ``vx.capture`` uses): while it is active, the torch calls the model makes go through it,
and it applies the rules below to those calls only. Nothing of the model or of torch is patched:
no class, no module attribute; the one kind of hook (on the activation modules of a given model,
below) lives only inside the ``with`` block; leaving it ends every effect (the autograd graph built
inside keeps the rules for its backward). Forward values are unchanged (up to the
rounding of a norm recomputed in Python).

Rules (docs/methods.md, "AttnLRP and CP-LRP"):

- ``F.scaled_dot_product_attention`` (the fused kernel runs forward and backward): AttnLRP scales
  the gradient by 1/4 at q, 1/4 at k and 1/2 at v (the uniform rule on the two matmuls; the
  softmax keeps its gradient, AttnLRP eq. 13-14, lxt's ``wrap_attention_forward``); CP-LRP
  detaches q and k (Ali et al., ICML 2022: attention weights are constants); a float ``attn_mask``
  computed from the input (a score bias) gets x 1/2 (AttnLRP) or is detached (CP-LRP), as the same
  attention written out in Python gets from the rules below;
- ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``): computed here by projections and
  SDPA (with the rule above), the same arithmetic as torch's;
- ``F.layer_norm`` / ``F.rms_norm`` / ``F.group_norm`` (hybrid ViTs' ResNet stems): the standard
  deviation is detached (the identity rule on the normalisation, AttnLRP eq. 15; lxt's
  ``layer_norm_forward``);
- element-wise activations (GELU, SiLU, sigmoid, tanh, ReLU6 / hardtanh / clamp, hardsigmoid, ...; in place,
  ``x.sigmoid_()``, the same rule written into ``x``): the gradient becomes ``f(x) / x``
  (the identity rule, AttnLRP eq. 9; lxt's ``identity_rule_implicit``, same epsilon); an activation
  module of transformers or timm (GPT-2's ``NewGELUActivation`` writes the tanh GELU out in Python:
  its products, sum and power would get other rules) gets it as a whole when the model is given
  (:mod:`~vitexplain.methods.lrp_modules`; one working in place runs on a copy of its input), as do
  MetaFormer's ``SquaredReLU`` ``relu(x)^2`` and ``StarReLU`` ``s relu(x)^2 + b`` (the identity rule on
  ``relu(x)^2``, then the affine map: b takes its share like a bias; ``lrp_ops.star_relu_rule``);
- attention computed in Python (timm's default Swin, ``fused_attn=False``, Hugging Face "eager"):
  the two matmuls get the uniform rule below (equal to 1/4, 1/4, 1/2 at q, k, v); AttnLRP keeps
  the softmax's gradient, CP-LRP detaches the attention weights;
- the product of two activations (gated MLPs, ``a * b``, ``a @ b`` or ``torch.einsum`` with both
  computed from the input; in place, ``a.mul_(b)``, ``a *= b``): the gradient is halved at each (the uniform rule,
  AttnLRP eq. 7; an einsum of n activations gives each 1/n); a factor computed from the weights alone (Swin V2's ``logit_scale.exp()``) is a constant, its product kept linear;
- ``F.cosine_similarity`` (``vx.targets.similarity``): the norms are detached, so the relevance
  of a headless backbone sums to the cosine (plain gradients would sum to 0); ``F.normalize``
  (Swin V2's cosine attention on q and k) likewise: the norm is detached (RMSNorm / sqrt(d));
- ``F.batch_norm`` with running statistics (a model in eval mode: hierarchical models' convolution stages) is
  an affine map and keeps its gradient, as linears do; with batch statistics it is not covered;
- ``F.linear`` (and linears written ``torch.addmm(b, x, W)``, GPT-2's ``Conv1D``, or ``x @ W``) and
  convolutions: as they are (the epsilon rule, with epsilon -> 0), or with
  ``linear_gamma`` / ``conv_gamma`` > 0 zennit's generalised Gamma rule (``zennit.rules.Gamma``:
  positive and negative contributions separated, weights ``w + gamma * w+`` / ``w + gamma * w-``).

A softmax that is not attention's (not over the last dim of a >= 3-D tensor) and the calls
:mod:`vitexplain.methods.lrp_coverage` lists (log-softmax, element-wise non-linearities of an activation, fused
products of two activations, BatchNorm with batch statistics, FlexAttention, ...) are not covered:
:class:`LRPRules` counts what it saw and :func:`~vitexplain.methods.lrp_coverage.check_coverage` raises instead of
returning maps that are not LRP.
"""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..errors import UsageError
from ..recording.flex import flex_code, flex_frame, keep_uncompiled
from .grad_layout import ContiguousGrad
from .lrp_coverage import flex_refused, uncovered_call
from .lrp_modules import ActivationModuleHooks
from .lrp_ops import (GAMMA_STABILIZER, IDENTITY_EPSILON, IdentityRule, LayerNormRule, ScaleGrad, cosine_rule,
                      gamma_rule, group_norm_rule, rms_norm_rule)

__all__ = ["LRPRules", "VARIANTS", "IDENTITY_EPSILON", "GAMMA_STABILIZER"]

#: The attention variants: ``"attnlrp"`` (AttnLRP) and ``"cp"`` (CP-LRP).
VARIANTS = ("attnlrp", "cp")


_SDPA = F.scaled_dot_product_attention
_compiling = torch.compiler.is_dynamo_compiling
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MHA = F.multi_head_attention_forward
_MHA_SIGNATURE = inspect.signature(_MHA)
_ACTIVATIONS = {
    F.gelu, F.silu, F.mish, F.elu, F.celu, F.selu, F.leaky_relu, F.hardswish, F.softplus,
    torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid, torch.tanh, torch.Tensor.tanh, F.tanh, torch.special.expit,
    F.relu6, F.hardtanh, F.hardsigmoid, F.logsigmoid, F.softsign, torch.clamp, torch.Tensor.clamp, torch.clip,
    torch.Tensor.clip,
}
_CLAMPS = {torch.clamp, torch.Tensor.clamp, torch.clip, torch.Tensor.clip}
#: In-place spellings of activations and of the product: the rule on the out-of-place call, written into the input.
_IN_PLACE = {torch.Tensor.sigmoid_: torch.sigmoid, torch.sigmoid_: torch.sigmoid, torch.Tensor.tanh_: torch.tanh,
             torch.tanh_: torch.tanh, F.elu_: F.elu, F.leaky_relu_: F.leaky_relu, F.celu_: F.celu, F.selu_: F.selu,
             F.hardtanh_: F.hardtanh, torch.Tensor.clamp_: torch.clamp, torch.clamp_: torch.clamp,
             torch.Tensor.clip_: torch.clip, torch.clip_: torch.clip, torch.Tensor.mul_: torch.mul,
             torch.Tensor.__imul__: torch.mul}
_PRODUCTS = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__,
             torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_ADDMM = {torch.addmm, torch.Tensor.addmm}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
_SOFTMAX = {torch.softmax, torch.Tensor.softmax, F.softmax, torch.special.softmax}
_CONVS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}


class LRPRules(ActivationModuleHooks, TorchFunctionMode):
    """Applies the LRP rules to the torch calls made while it is active (see the module docstring).

    Args:
        variant: ``"attnlrp"`` or ``"cp"`` (what happens at attention).
        linear_gamma: Gamma rule's gamma for ``F.linear`` calls (0 = as they are, epsilon).
        conv_gamma: Gamma rule's gamma for convolutions (0 = as they are).
        model: the explained model: while the rules are active, its element-wise activation modules
            (transformers' and timm's, some written out in Python arithmetic, e.g. GPT-2's
            ``NewGELUActivation``) and its RMSNorms written out in Python (Hugging Face's ``...RMSNorm``)
            get their rule as a whole (:func:`~vitexplain.methods.lrp_ops.activation_module`), by a
            forward hook removed on exit.

    Attributes:
        seen: how many calls of each kind the rules were applied to (``"attention"``,
            ``"norm"``, ``"activation"``, ``"product"``, ``"gamma"``), and ``"uncovered"``:
            descriptions of non-linear calls no rule covers (see
            :func:`~vitexplain.methods.lrp_coverage.check_coverage`).
    """

    def __init__(self, variant: str = "attnlrp", *, linear_gamma: float = 0.0, conv_gamma: float = 0.0,
                 model: Optional[nn.Module] = None) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise UsageError(f"unknown LRP variant {variant!r}; choose from {VARIANTS}")
        self.model = model
        self._inside = 0  # > 0 while an activation module runs (its inner calls get no rule)
        # per open hooked module call: None (its calls get the rules one by one), or (its input, the input's version,
        # the clone the module ran on when it works in place; see _enter_activation)
        self._calls: list[Optional[tuple[Tensor, int, Optional[Tensor]]]] = []
        self._handles: list[Any] = []
        self._thread = threading.get_ident()
        self.variant = variant
        self.linear_gamma = float(linear_gamma)
        self.conv_gamma = float(conv_gamma)
        self.seen: dict[str, Any] = {"attention": 0, "norm": 0, "activation": 0, "product": 0, "gamma": 0,
                                     "uncovered": []}
        self._data: dict[Any, bool] = {}  # autograd node -> whether its graph reaches the data (memo of _live)
        self._flex: Any = None  # flex_attention's code, while it is imported (its calls are refused)

    # -- scope: activation modules of ``model`` get the identity rule as a whole -----------------
    def __enter__(self) -> "LRPRules":
        self._thread = threading.get_ident()  # the mode is this thread's: hooks ignore other threads' forwards
        self._flex = flex_code()
        if self._flex is not None:  # (a compiled FlexAttention call that falls back to eager then reaches the refusal)
            keep_uncompiled(LRPRules.__torch_function__.__code__)
        self._hook_modules()
        try:
            return super().__enter__()
        except BaseException:
            self._remove_hooks()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            result = super().__exit__(*exc)
        finally:
            self._remove_hooks()
        error = exc[1] if len(exc) > 1 else None
        if isinstance(error, NotImplementedError) and "FlexAttention does not support backward on CPU" in str(error):
            # a torch.compile-d FlexAttention call: dynamo ran its checks, out of the rules' sight (torch's own error)
            raise flex_refused(self.variant) from error
        return result

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if self._flex is not None and not _compiling() and flex_frame(sys._getframe(1), self._flex) is not None:
            raise flex_refused(self.variant)  # (its validation's torch calls: before the kernel, before torch's error)
        if self._inside:  # inside an activation module: its output gets the identity rule as a whole
            return func(*args, **kwargs)
        if func is _SDPA:
            return self._sdpa(args, kwargs)
        if func is _MHA:
            return self._mha(args, kwargs)
        if func is F.layer_norm:
            return self._layer_norm(*args, **kwargs)
        if func is getattr(F, "rms_norm", None):
            return self._rms_norm(*args, **kwargs)
        if func is F.normalize:
            return self._normalize(*args, **kwargs)
        if func is F.group_norm:
            return self._group_norm(*args, **kwargs)
        if func is F.batch_norm:
            return self._batch_norm(args, kwargs)
        if func in _IN_PLACE and args and isinstance(args[0], Tensor) and args[0].requires_grad:
            return self._in_place(_IN_PLACE[func], args, kwargs)
        if func in _CLAMPS and any(isinstance(a, Tensor) for a in (*args[1:], *kwargs.values())):
            return func(*args, **kwargs)  # bounds that are tensors: an element-wise max/min, which keeps its gradient
        if func in _ACTIVATIONS and args and isinstance(args[0], Tensor) and args[0].requires_grad:
            self.seen["activation"] += 1
            # out of place (the identity rule reads the input after the call): a positional bool is `inplace`
            rest = tuple(False if isinstance(a, bool) else a for a in args[1:])
            kw = {k: v for k, v in kwargs.items() if k != "inplace"}
            out = IdentityRule.apply(lambda t: func(t, *rest, **kw), args[0])
            if kwargs.get("inplace") or any(isinstance(a, bool) and a for a in args[1:]):
                return args[0].copy_(out)
            return out
        if func in _PRODUCTS and len(args) == 2 and self._live(args[0]) and self._live(args[1]):
            self.seen["product"] += 1
            return ScaleGrad.apply(func(*args, **kwargs), 0.5)
        if func is torch.einsum:
            return self._einsum(args, kwargs)
        if func in _SOFTMAX:
            return self._softmax(func, args, kwargs)
        if func is F.cosine_similarity:
            return self._cosine(*args, **kwargs)
        if func is F.linear and self.linear_gamma > 0:
            return self.linear(*args, **kwargs)
        if self.linear_gamma > 0 and (func in _ADDMM or func in _MATMUL):
            written = self._written_linear(func, args, kwargs)
            if written is not None:
                return written
        if func in _CONVS and self.conv_gamma > 0:
            return self._conv(func, args, kwargs)
        why = uncovered_call(func, args, kwargs, self._live)
        if why:
            self.seen["uncovered"].append(why)
        return func(*args, **kwargs)

    # -- activations and constants ------------------------------------------------------
    def _in_place(self, func: Callable, args: tuple, kwargs: dict) -> Tensor:
        """``x.sigmoid_()``, ``F.elu_(x)``, ``a.mul_(b)``, ``a *= b``: the rules of ``func`` (the out-of-place call)
        on a copy of ``x`` (its autograd node and values are what the rules read), written back into ``x``."""
        x, rest = args[0], args[1:]
        copy = x.clone()
        rest = tuple(copy if r is x else r for r in rest)  # (a.mul_(a): both factors are the input)
        return x.copy_(self.__torch_function__(func, (), (copy, *rest), kwargs))

    def _live(self, t: Any) -> bool:
        """Whether ``t`` is an activation: computed from the data (the input, or token embeddings looked up
        by the data's ids), not from the weights alone.

        A tensor computed from parameters only (a learned temperature ``t.exp()``, Swin V2's
        ``logit_scale``) is a constant of its layer, like a weight: a product with it is linear and
        keeps its gradient (the uniform rule, AttnLRP eq. 7, is for products of two activations).
        Decided on the autograd graph, so it does not depend on whether the weights require grad:
        ``t`` is live when its graph reaches a leaf that is not an ``nn.Parameter`` (the input) or an
        embedding lookup (``F.embedding``: token ids are data). Memoised per node for the forward.
        """
        if not isinstance(t, Tensor) or not t.requires_grad:
            return False
        if t.grad_fn is None:
            return not isinstance(t, nn.Parameter)
        memo = self._data
        stack: list[tuple[Any, bool]] = [(t.grad_fn, False)]
        while stack:
            node, expanded = stack.pop()
            if node in memo:
                continue
            if expanded:
                memo[node] = any(memo.get(child, False) for child, _ in node.next_functions if child is not None)
                continue
            variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
            if variable is not None or type(node).__name__.startswith("EmbeddingBackward"):
                memo[node] = variable is None or not isinstance(variable, nn.Parameter)
                continue
            stack.append((node, True))
            stack.extend((child, False) for child, _ in node.next_functions if child is not None and child not in memo)
        return memo[t.grad_fn]

    def _einsum(self, args: tuple, kwargs: dict) -> Tensor:
        """``torch.einsum`` of n >= 2 activations: a multilinear product, the uniform rule gives each 1/n."""
        operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        live = sum(1 for t in operands if self._live(t))
        out = torch.einsum(*args, **kwargs)
        if live < 2:
            return out
        self.seen["product"] += 1
        return ScaleGrad.apply(out, 1.0 / live)

    # -- attention ----------------------------------------------------------------------
    def _qkv(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.seen["attention"] += 1
        if self.variant == "cp":
            return q.detach(), k.detach(), v
        return ScaleGrad.apply(q, 0.25), ScaleGrad.apply(k, 0.25), ScaleGrad.apply(v, 0.5)

    def _softmax(self, func: Callable, args: tuple, kwargs: dict) -> Tensor:
        """Attention computed in Python: ``softmax(q k^T + bias) @ v``, over the last dim of a >= 3-D tensor.

        Its two matmuls get the uniform rule (the products of two activations, which halves the
        gradient at q, k, p and v: the same as 1/4, 1/4, 1/2 at SDPA); AttnLRP keeps the softmax's
        gradient, CP-LRP detaches its output (q and k detached). Any other softmax on the path is
        not covered.
        """
        x = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        out = func(*args, **kwargs)
        if not self._live(x):
            return out
        if x.dim() >= 3 and dim in (-1, x.dim() - 1):
            self.seen["attention"] += 1
            return out.detach() if self.variant == "cp" else out
        self.seen["uncovered"].append(f"softmax over dim {dim} of a {x.dim()}-D tensor (not attention)")
        return out

    def _sdpa(self, args: tuple, kwargs: dict) -> Tensor:
        """SDPA with the rule at q, k, v; an additive ``attn_mask`` computed from the input (a bias from
        the queries, SAM-style relative positions) is part of the scores, so it gets their share: x 1/2
        (AttnLRP: the ``A @ v`` product's half, which the rule's 1/4 at q and k already include) or
        detached (CP-LRP: the attention weights are constants), as in the same attention written out."""
        bound = dict(zip(_SDPA_ARGS, args))
        bound.update(kwargs)
        bound["query"], bound["key"], bound["value"] = self._qkv(bound["query"], bound["key"], bound["value"])
        mask = bound.get("attn_mask")
        if self._live(mask) and mask.is_floating_point():
            bound["attn_mask"] = mask.detach() if self.variant == "cp" else ScaleGrad.apply(mask, 0.5)
        return _SDPA(**bound)

    def _mha(self, args: tuple, kwargs: dict) -> tuple[Tensor, Optional[Tensor]]:
        """``F.multi_head_attention_forward`` as projections + SDPA (the rule applied at SDPA)."""
        from .lrp_mha import multi_head_attention

        bound = _MHA_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        return multi_head_attention(self, **bound.arguments)

    def _written_linear(self, func: Callable, args: tuple, kwargs: dict) -> Optional[Tensor]:
        """A linear layer written as ``torch.addmm(b, x, W)`` (GPT-2's ``Conv1D``) or ``x @ W`` (OpenCLIP's
        projection), W a 2-D tensor computed from the weights alone: :meth:`linear` of ``x, W^T, b``; None when
        the call is not one."""
        if func in _ADDMM:
            if len(args) != 3 or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
                return None
            bias, x, w = args
            if not (isinstance(bias, Tensor) and bias.dim() == 1) or self._live(bias):
                return None
        else:
            if len(args) != 2 or kwargs:
                return None
            (x, w), bias = args, None
        if not (isinstance(w, Tensor) and w.dim() == 2 and self._live(x) and not self._live(w)):
            return None
        return self.linear(x, w.t(), bias)

    def linear(self, input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        """``F.linear`` under the rules: as it is, or the Gamma rule when ``linear_gamma`` > 0."""
        if self.linear_gamma <= 0:
            return F.linear(input, weight, bias)
        self.seen["gamma"] += 1
        return gamma_rule(F.linear, input, weight, bias, self.linear_gamma)

    # -- norms ----------------------------------------------------------------------------
    def _layer_norm(self, x: Tensor, normalized_shape: Any, weight: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
        self.seen["norm"] += 1
        return LayerNormRule.apply(x, tuple(normalized_shape), weight, bias, eps)

    def _rms_norm(self, x: Tensor, normalized_shape: Any, weight: Optional[Tensor] = None,
                  eps: Optional[float] = None) -> Tensor:
        self.seen["norm"] += 1
        return rms_norm_rule(x, normalized_shape, weight, eps)

    def _group_norm(self, input: Tensor, num_groups: int, weight: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
        """``F.group_norm`` (hybrid ViTs' ResNet stems): :func:`~vitexplain.methods.lrp_ops.group_norm_rule`."""
        self.seen["norm"] += 1
        return group_norm_rule(input, num_groups, weight, bias, eps)

    def _normalize(self, input: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12,
                   out: Optional[Tensor] = None) -> Tensor:
        """``F.normalize`` (Swin V2's cosine attention on q and k): the same arithmetic as torch's, with the
        norm held constant. The L2 case is RMSNorm divided by sqrt(d), so the norms' identity rule applies."""
        if out is not None:
            raise UsageError("the LRP rules do not support F.normalize(..., out=...); call it without out")
        self.seen["norm"] += 1
        return input / input.norm(p, dim, keepdim=True).clamp_min(eps).expand_as(input).detach()

    def _cosine(self, x1: Tensor, x2: Tensor, dim: int = 1, eps: float = 1e-8) -> Tensor:
        return cosine_rule(x1, x2, dim, eps)

    # -- convolutions -----------------------------------------------------------------------
    def _batch_norm(self, args: tuple, kwargs: dict) -> Tensor:
        """``F.batch_norm`` as it is (with running statistics an affine map: it keeps its gradient), its incoming
        gradient made contiguous first (:class:`~vitexplain.methods.grad_layout.ContiguousGrad`: PyTorch's backward
        of it is wrong for a channels-last gradient of a contiguous input, a batch of one image's usual case)."""
        why = uncovered_call(F.batch_norm, args, kwargs, self._live)
        if why:
            self.seen["uncovered"].append(why)
        out = F.batch_norm(*args, **kwargs)
        return ContiguousGrad.apply(out) if out.requires_grad and out.dim() > 2 else out

    def _conv(self, func: Callable, args: tuple, kwargs: dict) -> Tensor:
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        x, weight, bias = bound.pop("input"), bound.pop("weight"), bound.pop("bias", None)
        self.seen["gamma"] += 1

        def layer(inp: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
            return func(inp, w, b, **bound)

        return gamma_rule(layer, x, weight, bias, self.conv_gamma, channel_dim=1)
