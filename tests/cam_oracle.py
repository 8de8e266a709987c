"""A layer's activation and its gradient by hand (a forward hook and ``torch.autograd.grad``): what the Grad-CAM
family's oracles in the CNN tests are computed from."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def act_grad(model: nn.Module, layer: str, x: Tensor, classes) -> tuple[Tensor, Tensor]:
    """A (B, C, h, w) of module ``layer`` (detached) and the gradient of the ``classes`` logits' sum to it."""
    store = {}
    handle = model.get_submodule(layer).register_forward_hook(lambda m, i, o: store.__setitem__("a", o))
    try:
        logits = model(x)
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(logits[torch.arange(len(x)), classes].sum(), store["a"])
    return store["a"].detach(), grad
