"""Training-only value-path token labels for the zoo's timm Hiera (``shapes-hier``).

Like everything in :mod:`vitexplain.zoo.signals`, nothing here is saved with the model: the
learned scale and bias live beside it, and the forward hooks it puts on the model's blocks are
removed by :meth:`HieraValueLabels.remove` (called by ``TrainingSignals.remove``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UsageError

__all__ = ["HieraValueLabels", "head_width_blocks"]


def head_width_blocks(model: nn.Module) -> list[int]:
    """The blocks of a timm Hiera whose attention writes at the head's width (``num_features``).

    Their attention outputs are added to the tokens that the head mean-pools (through the blocks
    after them), so the head can read each key token's value directly.
    """
    return [i for i, blk in enumerate(model.blocks) if int(blk.attn.dim_out) == int(model.num_features)]


class HieraValueLabels(nn.Module):
    """*Value-path token labels* for a timm Hiera classifier: the hierarchical analogue of
    :class:`~vitexplain.zoo.signals.ValueLabels`.

    In each listed block (default :func:`head_width_blocks`: the blocks whose attention writes at
    the head's width; in ``shapes-hier`` the block pooling into the last stage, whose new tokens
    attend to their 2 x 2 children, and the last stage's global block) what key token j adds to the
    tokens it is attended from is its value through the output projection,
    ``o_j = W_proj W_v LN_1(x_j)`` (a (B, N_k, C) map). The head reads the mean of the last tokens
    after a LayerNorm, so, to first order, ``o_j`` moves the logits by ``W_fc (gamma * centre(o_j))``
    (gamma: the head norm's scale). This loss asks that per-key logit, with a learned scale and bias
    (training-only, one per block), to predict the shape classes covering key j's image region
    (binary cross-entropy against the soft coverage at the key grid's stride; the keys are put back
    on their grid by the model's own ``reroll``). The model then reads each class from its own
    object's tokens rather than from the other objects', which is what class-discriminative
    attention maps (``generic``) report; the model is unchanged in form.

    Args:
        model: a timm ``Hiera`` classifier.
        blocks: block indices (default :func:`head_width_blocks`).
    """

    def __init__(self, model: nn.Module, blocks: Optional[Sequence[int]] = None) -> None:
        super().__init__()
        self.model = [model]  # a list: not a submodule (its parameters are trained by the main group)
        self.blocks = head_width_blocks(model) if blocks is None else list(blocks)
        width = int(model.num_features)
        for b in self.blocks:
            if int(model.blocks[b].attn.dim_out) != width:
                raise UsageError(f"block {b} writes at width {model.blocks[b].attn.dim_out}, not the head's {width}")
        self.log_scale = nn.Parameter(torch.zeros(len(self.blocks)))  # a positive scale: the sign is the model's
        self._tokens: dict[int, torch.Tensor] = {}
        self._hooks = [model.blocks[b].norm1.register_forward_hook(self._grabber(b)) for b in self.blocks]

    def _grabber(self, b: int) -> Any:
        def grab(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            self._tokens[b] = out
        return grab

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self._hooks:
            h.remove()

    def per_key_logits(self, k: int) -> torch.Tensor:
        """The k-th listed block's per-key logits on the key grid: (B, h, w, num_classes)."""
        model = self.model[0]
        b = self.blocks[k]
        attn = model.blocks[b].attn
        d = int(attn.dim_out)
        v_bias = None if attn.qkv.bias is None else attn.qkv.bias[2 * d:]
        o = F.linear(F.linear(self._tokens[b], attn.qkv.weight[2 * d:], v_bias), attn.proj.weight)  # (B, N_k, C)
        o = o - o.mean(dim=-1, keepdim=True)
        z = F.linear(o * model.head.norm.weight, model.head.fc.weight) * self.log_scale[k].exp()
        # the keys are the previous block's output tokens, in its (unrolled) order
        return model.reroll(z, b - 1) if b > 0 else model.reroll(z, 0)

    def forward(self, coverage: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """``coverage(g)``: the shape coverage of the batch the model has just run on, on a g x g grid
        ((B, C + 1, g, g), background last; ``patch_targets(batch, H // g)[0]``)."""
        losses = []
        for k in range(len(self.blocks)):
            z = self.per_key_logits(k)  # (B, h, w, C)
            cover = coverage(z.shape[1])[:, :-1]  # (B, C, h, w), no background
            losses.append(F.binary_cross_entropy_with_logits(z.permute(0, 3, 1, 2), cover))
        return torch.stack(losses).mean()
