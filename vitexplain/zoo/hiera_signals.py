"""Training-only value-path token labels for the zoo's timm Hiera (``shapes-hier``).

Like everything in :mod:`vitexplain.zoo.signals`, nothing here is saved with the model: the
learned scale and bias live beside it, and the forward hooks it puts on the model's blocks are
removed by :meth:`HieraValueLabels.remove` (called by ``TrainingSignals.remove``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UsageError
from .outputs import Outputs

__all__ = ["HieraValueLabels", "head_width_blocks", "balanced_bce"]


def balanced_bce(logits: torch.Tensor, cover: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of per-key logits against soft class coverage (same shape), its positive
    term weighted by the batch's ratio of negative to positive coverage, so that the few positives weigh
    as much as all the negatives (the value-path token labels' loss)."""
    pos_weight = ((1.0 - cover).sum() / cover.sum().clamp(min=1.0)).detach()
    return F.binary_cross_entropy_with_logits(logits, cover, pos_weight=pos_weight)


def head_width_blocks(model: nn.Module) -> list[int]:
    """The blocks of a timm Hiera whose attention writes at the head's width (``num_features``).

    Their attention outputs are added to the tokens that the head mean-pools (through the blocks
    after them), so the head can read each key token's value directly.
    """
    return [i for i, blk in enumerate(model.blocks) if int(blk.attn.dim_out) == int(model.num_features)]


def _to_head_width(model: nn.Module, b: int, o: torch.Tensor) -> torch.Tensor:
    """Carry a (B, N, C_b) change of block ``b``'s output to the head's width along the residual path.

    Each later block that widens the tokens does so by ``proj(LN_1(x))`` (then a max over the 2 x 2
    pooled positions); to first order a change ``o`` of x becomes ``W_proj (gamma_1 * centre(o))``
    (the norm's 1 / sigma left out: a positive factor per token). Blocks that keep the width add
    ``o`` unchanged through their residual.
    """
    for blk in model.blocks[b + 1:]:
        if blk.proj is not None:
            o = F.linear((o - o.mean(dim=-1, keepdim=True)) * blk.norm1.weight, blk.proj.weight)
    return o


class HieraValueLabels(nn.Module):
    """*Value-path token labels* for a timm Hiera classifier: the hierarchical analogue of
    :class:`~vitexplain.zoo.vit_signals.ValueLabels`.

    In each listed block (default :func:`head_width_blocks`: the blocks whose attention writes at
    the head's width; in the mask-unit Hiera tried as ``shapes-hier`` (``--arch hiera``) the block
    pooling into the last stage, whose new tokens attend to their 2 x 2 children, and the last
    stage's global block) what key token j adds to the
    tokens it is attended from is its value through the output projection,
    ``o_j = W_proj (W_v LN_1(x_j) + b_v)`` (a (B, N_k, C_b) map; this is also what the gradient of an
    attention weight, ``dy / dA_ij = <dy / d out_i, o_j>``, reads). A block narrower than the head
    carries ``o_j`` on through the later blocks' widening projections (:func:`_to_head_width`).
    The head reads the mean of the last tokens after a LayerNorm, so, to first order, ``o_j`` moves
    the logits by ``W_fc (gamma * centre(o_j))`` (gamma: the head norm's scale). This loss asks that
    per-key logit, times a learned positive scale (training-only, one per block) and with no bias,
    to predict the shape classes covering key j's image region (binary cross-entropy against the
    soft coverage at the key grid's stride, its positive term weighted by the batch's ratio of
    negative to positive coverage, so that the few (key, own class) pairs weigh as much as all the
    others; the keys are put back on their grid by the model's own ``reroll``): positive for the
    classes of its own object, negative for background and for other objects. The model is meant
    to read each class from its own object's tokens rather than from the other objects', which is
    what class-discriminative attention maps (``generic``) report; the model is unchanged in form.
    Measured effect in ``shapes-hier``'s Hiera: :mod:`vitexplain.zoo.recipes`.

    Args:
        model: a timm ``Hiera`` classifier.
        blocks: block indices (default :func:`head_width_blocks`).
        per_head: label each head's share of ``o_j`` on its own (``generic`` clamps each head's
            ``A * dy/dA`` at 0 before the mean over heads, so a head adding a class from the other
            object shows there even when the heads' sum does not).
    """

    def __init__(self, model: nn.Module, blocks: Optional[Sequence[int]] = None, per_head: bool = False) -> None:
        super().__init__()
        self.per_head = per_head
        self.model = [model]  # a list: not a submodule (its parameters are trained by the main group)
        self.blocks = head_width_blocks(model) if blocks is None else list(blocks)
        if any(not 0 <= b < len(model.blocks) for b in self.blocks):
            raise UsageError(f"value-label blocks {self.blocks} are not all blocks of this "
                             f"{len(model.blocks)}-block Hiera")
        self.log_scale = nn.Parameter(torch.zeros(len(self.blocks)))  # a positive scale: the sign is the model's
        self._tokens = Outputs({b: model.blocks[b].norm1 for b in self.blocks})

    def remove(self) -> None:
        """Detach the hooks from the model."""
        self._tokens.remove()

    def per_key_logits(self, k: int) -> torch.Tensor:
        """The k-th listed block's per-key logits on the key grid: (B, h, w, H', num_classes), H' = the
        block's heads with ``per_head``, else 1 (the heads' sum)."""
        model = self.model[0]
        b = self.blocks[k]
        attn = model.blocks[b].attn
        d = int(attn.dim_out)
        v_bias = None if attn.qkv.bias is None else attn.qkv.bias[2 * d:]
        v = F.linear(self._tokens[b], attn.qkv.weight[2 * d:], v_bias)  # (B, N_k, d)
        if self.per_head:  # each head's share of o_j: W_proj[:, head] v_j[head]
            heads = int(attn.heads)
            o = torch.einsum("bnhe,che->bnhc", v.unflatten(-1, (heads, d // heads)),
                             attn.proj.weight.unflatten(-1, (heads, d // heads)))  # (B, N_k, H, d)
        else:
            o = F.linear(v, attn.proj.weight)[:, :, None]  # (B, N_k, 1, d)
        o = _to_head_width(model, b, o)
        o = o - o.mean(dim=-1, keepdim=True)
        z = F.linear(o * model.head.norm.weight, model.head.fc.weight) * self.log_scale[k].exp()  # (B, N_k, H', C)
        # the keys are the previous block's output tokens, in its (unrolled) order
        z_grid = model.reroll(z.flatten(2), max(b - 1, 0))  # (B, h, w, H' C)
        return z_grid.unflatten(-1, z.shape[-2:])

    def forward(self, coverage: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """``coverage(g)``: the shape coverage of the batch the model has just run on, on a g x g grid
        ((B, C + 1, g, g), background last; ``patch_targets(batch, H // g)[0]``)."""
        losses = []
        for k in range(len(self.blocks)):
            z = self.per_key_logits(k)  # (B, h, w, H', C)
            cover = coverage(z.shape[1])[:, :-1].permute(0, 2, 3, 1)[:, :, :, None]  # (B, h, w, 1, C), no background
            cover = cover.expand_as(z)
            losses.append(balanced_bce(z, cover))
        return torch.stack(losses).mean()
