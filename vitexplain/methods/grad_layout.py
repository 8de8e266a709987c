"""Input gradients through eval-mode BatchNorm, whatever the gradient's memory layout.

PyTorch's CPU backward of an eval ``batch_norm`` (torch 2.14) returns wrong input gradients when its input is
contiguous (N, C, H, W) and the gradient arrives with channels-last strides, which is what a (1, C, H, W) map gets
back from ``x.flatten(2).transpose(1, 2)``: LeViT's stem, whose last BatchNorm2d feeds its tokens, gave one image's
Integrated Gradients, SmoothGrad and AttnLRP maps off by more than the map itself at batch 1, while a batch of 2
(other strides) was right. A contiguous gradient takes the correct path in every layout. The gradient that goes
wrong has strides (C, 1, W * C, C) at batch 1: what a LayerNorm, einsum or attention over those tokens hands back.

Used by the explained forward with gradients (``Explainer.explain``: the Grad-CAM family of a hybrid whose stage
feeds such a norm, EfficientFormer's ``stages.2``, got one image's map off by its own size), Grad-CAM's own pass
for a module that is not a stage, the captum forwards and the LRP rules.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

from torch import Tensor, nn
from torch.autograd import Function

__all__ = ["ContiguousGrad", "contiguous_norm_grads"]


class ContiguousGrad(Function):
    """Identity forward; the incoming gradient made contiguous (put after an eval ``batch_norm``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.detach()  # an alias, not a view: the caller may modify it in place

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _contiguous_output(module: nn.Module, inputs: Any, output: Any) -> Optional[Tensor]:
    if isinstance(output, Tensor) and output.dim() > 2 and output.requires_grad:
        return ContiguousGrad.apply(output)
    return None


@contextmanager
def contiguous_norm_grads(model: nn.Module) -> Iterator[None]:
    """Within the scope, each BatchNorm module of ``model`` hands its backward a contiguous gradient (forward hooks,
    removed on exit; the graph built inside keeps the rule for its backward after it)."""
    handles = []
    try:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                handles.append(module.register_forward_hook(_contiguous_output))
        yield
    finally:
        for handle in handles:
            handle.remove()
