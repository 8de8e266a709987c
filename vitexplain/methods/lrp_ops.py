"""The autograd pieces of the LRP rules (:mod:`vitexplain.methods.lrp_rules`): identity forwards with changed
gradients, the identity rule (on a call or on an activation module), LayerNorm, RMSNorm, GroupNorm and the cosine
with their standard deviation or norm held constant, zennit's Gamma rule.

Each is a pure function of its tensors; which torch call gets which is decided by
:class:`~vitexplain.methods.lrp_rules.LRPRules`. Sources: docs/methods.md ("AttnLRP and CP-LRP").
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.autograd import Function

__all__ = ["IDENTITY_EPSILON", "GAMMA_STABILIZER", "ScaleGrad", "IdentityRule", "ActivationModuleRule", "LayerNormRule",
           "rms_norm_rule", "group_norm_rule", "cosine_rule", "activation_module", "star_relu_rule", "gamma_rule"]

#: lxt's ``identity_rule_implicit`` epsilon: the gradient is ``f(x) / (x + 1e-10)``.
IDENTITY_EPSILON = 1e-10

#: zennit's default stabilizer of the Gamma rule's denominators.
GAMMA_STABILIZER = 1e-6

#: Modules of element-wise activations (some written out in Python arithmetic, which the rules on single
#: torch calls would split into products, sums and powers): the identity rule applies to the module.
_ACTIVATION_MODULES = ("transformers.activations", "timm.layers.activations", "timm.layers.activations_me")

#: Where timm defines MetaFormer's (PoolFormer, ConvFormer, CAFormer) own activations: ``SquaredReLU`` ``relu(x)^2``
#: and ``StarReLU`` ``s relu(x)^2 + b`` (Yu et al., "MetaFormer baselines for vision", 2022), each with a ReLU child.
_METAFORMER = "timm.models.metaformer"


class ScaleGrad(Function):
    """Identity forward; the gradient multiplied by ``factor`` (lxt's ``divide_gradient``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.detach()  # an alias, not a view: the caller may modify it in place (attn += bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


class IdentityRule(Function):
    """``fn(x)`` forward; the gradient ``fn(x) / (x + eps)`` times the incoming one (identity rule).

    The ratio is computed in float32 at least: in float16 ``eps`` rounds away, and an exact zero
    input (a pruned unit, an underflow) gave 0 / 0 = NaN where float32 gives lxt's 0."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        out = fn(x)
        wide = torch.promote_types(x.dtype, torch.float32)
        ctx.save_for_backward((out.to(wide) / (x.to(wide) + IDENTITY_EPSILON)).to(out.dtype))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        (ratio,) = ctx.saved_tensors
        return None, ratio * grad


class ActivationModuleRule(Function):
    """An activation module's output ``out`` forward; the gradient ``out / (x + eps)`` to its input ``x`` and
    none through the arithmetic inside it (the identity rule on the module as one element-wise function).

    ``exact=True`` (an RMSNorm module: ``out = x * c`` with ``c`` the weight over the held root mean square): the
    gradient ``out / x`` without the epsilon, which would bend ``c`` where ``|x|`` is within a few orders of 1e-10
    (measured: a Gemma 3 residual unit of 1.1e-8 moved a token's relevance by 1e-4 of the map), and 0 where x = 0."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out: Tensor, exact: bool = False) -> Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        xw, ow = x.to(wide), out.to(wide)
        if exact:
            ratio = torch.where(xw != 0, ow / torch.where(xw != 0, xw, torch.ones_like(xw)), torch.zeros_like(ow))
        else:
            ratio = ow / (xw + IDENTITY_EPSILON)
        ctx.save_for_backward(ratio.to(out.dtype))
        return out.detach()  # an alias, not a view: the caller may modify it in place

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (ratio,) = ctx.saved_tensors
        return ratio * grad, None, None


def activation_module(module: nn.Module) -> Optional[str]:
    """Whether a module's forward, perhaps Python arithmetic, gets its rule as a whole, and which.

    ``"activation"``: a parameter-free module of transformers' or timm's activation modules (GPT-2's
    ``NewGELUActivation`` is ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))``): the identity rule.
    ``"norm"``: an RMSNorm written out in Python (a class named ``...RMSNorm`` outside torch: Hugging Face's
    ``x * rsqrt(mean(x^2) + eps) * w``): with the root mean square held constant (the norms' identity rule)
    the output is ``x`` times a per-element constant, so the gradient is ``out / x``, the same ratio.
    ``"star_relu"``: MetaFormer's ``StarReLU`` ``s relu(x)^2 + b`` (scale s and bias b learned scalars): the identity
    rule on the element-wise ``relu(x)^2``, then the affine map (:func:`star_relu_rule`). MetaFormer's
    ``SquaredReLU`` ``relu(x)^2`` is an ``"activation"`` (both hold a ReLU child, hence checked first).
    None: neither (torch's own modules call functions the rules see).
    """
    cls = type(module)
    if cls.__module__ == _METAFORMER and cls.__name__ in ("SquaredReLU", "StarReLU"):
        return "activation" if cls.__name__ == "SquaredReLU" else "star_relu"
    if list(module.children()) or cls.__module__.startswith("torch."):
        return None
    if cls.__module__ in _ACTIVATION_MODULES and next(module.parameters(recurse=False), None) is None:
        return "activation"
    if cls.__name__.endswith("RMSNorm"):
        return "norm"
    return None


def star_relu_rule(module: nn.Module, x: Tensor) -> Tensor:
    """MetaFormer's StarReLU ``s relu(x)^2 + b`` of ``x`` (any shape), with the LRP rules of its two parts.

    ``relu(x)^2`` is an element-wise non-linearity of one input: the identity rule (AttnLRP eq. 9), gradient
    ``relu(x)^2 / (x + eps)``, passes its relevance whole. ``s u + b`` is an affine map with constants s and b
    (learned parameters, like a linear layer's): it keeps its gradient s (the epsilon rule, epsilon -> 0), so b
    takes the share ``b / (s u + b)`` of the output's relevance, as every bias does under these rules (with b = 0
    the relevance passes whole: conservative). Same forward values as the module's (the same operations in the
    same order).

    Args:
        module: a ``timm.models.metaformer.StarReLU`` (its ``scale`` and ``bias``, shape (1,)).
        x: its input; not modified.

    Returns:
        the module's output, shape of ``x``.
    """
    squared = torch.relu(x.detach()) ** 2  # (computed from a detached input: no rule sees this power)
    return module.scale * ActivationModuleRule.apply(x, squared) + module.bias


class LayerNormRule(Function):
    """``F.layer_norm`` forward (the fused kernel); the gradient of ``(x - mean(x)) * w / std`` with the
    standard deviation held constant (lxt's ``layer_norm_forward``): ``(g w - mean(g w)) / std``.
    Only the input gets a gradient (the relevance needs no parameter gradients)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, shape: tuple, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
        out, _, rstd = torch.native_layer_norm(x, list(shape), weight, bias, eps)
        ctx.save_for_backward(rstd, weight)
        ctx.dims = tuple(range(-len(shape), 0))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        rstd, weight = ctx.saved_tensors
        g = grad if weight is None else grad * weight
        return (g - g.mean(dim=ctx.dims, keepdim=True)) * rstd, None, None, None, None


def rms_norm_rule(x: Tensor, normalized_shape: Any, weight: Optional[Tensor], eps: Optional[float]) -> Tensor:
    """``F.rms_norm`` recomputed with its root mean square held constant (the norms' identity rule).

    Args:
        x: (..., *normalized_shape).
        eps: None: the machine epsilon of ``x``'s dtype (torch's default).
    """
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    y = x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps).detach()
    return y if weight is None else y * weight


def group_norm_rule(input: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor],
                    eps: float) -> Tensor:
    """``F.group_norm`` of (N, C, ...): LayerNorm over each group of channels, its standard deviation held
    constant (the norms' identity rule); the forward recomputed in Python."""
    n, c = input.shape[:2]
    groups = input.reshape(n, num_groups, -1)
    var = groups.var(dim=-1, unbiased=False, keepdim=True)
    out = ((groups - groups.mean(dim=-1, keepdim=True)) * torch.rsqrt(var + eps).detach()).view_as(input)
    shape = (1, c) + (1,) * (input.dim() - 2)
    if weight is not None:
        out = out * weight.view(shape)
    return out if bias is None else out + bias.view(shape)


def cosine_rule(x1: Tensor, x2: Tensor, dim: int, eps: float) -> Tensor:
    """``F.cosine_similarity`` with both norms held constant: the relevance sums to the cosine."""
    n1 = x1.norm(dim=dim).clamp(min=eps).detach()
    n2 = x2.norm(dim=dim).clamp(min=eps).detach()
    return (x1 * x2).sum(dim=dim) / (n1 * n2)


def _stabilize(z: Tensor) -> Tensor:
    """zennit's stabilizer: ``z + eps * sign(z)`` with sign(0) = 1."""
    return z + GAMMA_STABILIZER * torch.where(z >= 0, 1.0, -1.0).to(z.dtype)


def gamma_rule(layer: Callable[..., Tensor], x: Tensor, weight: Tensor, bias: Optional[Tensor], gamma: float,
               channel_dim: int = -1) -> Tensor:
    """zennit's generalised Gamma rule on one linear or convolution call, in Gradient x Input form.

    The output equals ``layer(x, weight, bias)``; its gradient is such that ``x * dx`` is
    zennit's ``Gamma(gamma)`` relevance of the output relevance ``y * dy``: for outputs y > 0,
    ``R_in = x+ * (w + g w+)^T s+ + x- * (w + g w-)^T s+`` with
    ``s+ = R / (layer(x+, w + g w+, b + g b+) + layer(x-, w + g w-))``; for y < 0 likewise with
    the roles of w+ and w- exchanged (zennit ``rules.Gamma``, stabilizer 1e-6).

    Args:
        layer: ``fn(input, weight, bias)`` (F.linear or a convolution with its other arguments bound).
        x: the layer's input.
        weight, bias: its parameters.
        gamma: the Gamma rule's gamma (> 0).
        channel_dim: the output dimension the bias runs along (-1 linear, 1 convolution).

    Returns:
        the layer's output, of the shape ``layer`` returns.
    """
    y = layer(x, weight, bias)
    w_pos = weight + gamma * weight.clamp(min=0)
    w_neg = weight + gamma * weight.clamp(max=0)
    b_pos = None if bias is None else bias + gamma * bias.clamp(min=0)
    b_neg = None if bias is None else bias + gamma * bias.clamp(max=0)
    x_pos, x_neg = x.clamp(min=0), x.clamp(max=0)
    w_pos, w_neg = w_pos.detach(), w_neg.detach()
    plus = layer(x_pos, w_pos, None) + layer(x_neg, w_neg, None)  # the x-dependent part of z+ (y > 0)
    minus = layer(x_pos, w_neg, None) + layer(x_neg, w_pos, None)  # of z- (y < 0)
    with torch.no_grad():
        z_plus = plus if b_pos is None else plus + _along(b_pos, plus, channel_dim)
        z_minus = minus if b_neg is None else minus + _along(b_neg, minus, channel_dim)
        c_plus = torch.where(y > 0, y / _stabilize(z_plus), 0.0)
        c_minus = torch.where(y < 0, y / _stabilize(z_minus), 0.0)
    path = c_plus * plus + c_minus * minus
    return y.detach() + (path - path.detach())


def _along(b: Tensor, like: Tensor, dim: int) -> Tensor:
    """A bias (C,) shaped to broadcast along dimension ``dim`` of ``like``."""
    shape = [1] * like.dim()
    shape[dim] = -1
    return b.view(shape)
