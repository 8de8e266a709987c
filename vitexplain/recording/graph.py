"""Every attention call of a forward in the autograd graph, also when the model's weights are frozen.

A gradient method needs dy/dA for each attention call it reads. With ``model.requires_grad_(False)``
(inference code often freezes), an attention call whose inputs depend on no image pixel (a text
decoder's first self-attention over the caption's tokens alone) is in no graph, and the capture can
give it no gradient. :func:`embeddings_in_graph` puts each embedding's output into the graph for the
duration of the forward; the gradients themselves are unchanged and no ``.grad`` is written.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from torch import Tensor, nn

__all__ = ["embeddings_in_graph"]


def _in_graph(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: an embedding output outside the graph as a copy of a leaf that requires grad
    (a copy: the model may write into it, e.g. image features into the token embeddings)."""
    if isinstance(output, Tensor) and output.is_floating_point() and not output.requires_grad:
        return output.detach().requires_grad_(True).clone()
    return output


@contextmanager
def embeddings_in_graph(model: nn.Module) -> Iterator[None]:
    """Within the block, every ``nn.Embedding`` of ``model`` outputs a tensor in the autograd graph (hooks,
    removed on exit)."""
    hooks = [m.register_forward_hook(_in_graph) for m in model.modules() if isinstance(m, nn.Embedding)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
