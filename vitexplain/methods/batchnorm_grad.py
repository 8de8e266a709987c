"""A workaround for torch's CPU backward of an eval-mode ``F.batch_norm`` on a batch of one image.

With running statistics, ``F.batch_norm`` is an affine map per channel, so its input gradient is the incoming
gradient times ``weight / sqrt(running_var + eps)``. torch's CPU kernel (2.14) returns other values (O(1)
relative errors, measured against finite differences) when the batch holds one image and the incoming gradient
is channels-last with the batch dimension's stride not the image's size: what ``flatten(2).transpose(1, 2)``
after the norm gives (LeViT's patch embedding, timm's and Hugging Face's). One image alone was then explained
otherwise than in a batch by every method that takes gradients at the pixels. The gradient made contiguous
before the norm's backward gets the right values (any batch size, any device: a copy at most).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.overrides import TorchFunctionMode

__all__ = ["ContiguousGrad", "ContiguousBatchNormGrads"]


class ContiguousGrad(Function):
    """Identity forward; the incoming gradient made contiguous (put after an ``F.batch_norm``: see the module)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.detach()  # an alias, not a view: the caller may modify it in place

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


class ContiguousBatchNormGrads(TorchFunctionMode):
    """While active, every ``F.batch_norm`` output that requires grad is followed by :class:`ContiguousGrad`.

    Forward values are unchanged; nothing of the model or of torch is patched. For a forward whose input
    gradient is taken outside the other modes (the captum methods)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is F.batch_norm and isinstance(out, Tensor) and out.requires_grad:
            return ContiguousGrad.apply(out)
        return out
