"""Training-only value-path token labels for the zoo's timm PVTv2 (``shapes-hier --arch pvt``).

Like everything in :mod:`vitexplain.zoo.signals`, nothing here is saved with the model: the
learned scales live beside it, and the forward hooks it puts on the model's blocks are removed by
:meth:`PvtValueLabels.remove` (called by ``TrainingSignals.remove``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UsageError
from .hiera_signals import balanced_bce
from .outputs import Outputs

__all__ = ["PvtValueLabels", "pvt_blocks", "last_stage_blocks"]


def pvt_blocks(model: nn.Module) -> list[tuple[int, int]]:
    """``(stage, block in stage)`` of every block of a timm PVTv2, in forward order (the k-th entry is
    block k in the flat numbering that ``value_blocks`` uses)."""
    return [(s, i) for s, st in enumerate(model.stages) for i in range(len(st.blocks))]


def last_stage_blocks(model: nn.Module) -> list[int]:
    """Flat indices of the blocks of a timm PVTv2's last stage: the blocks whose attention writes at
    the head's width, onto the tokens the head mean-pools."""
    last = len(model.stages) - 1
    return [k for k, (s, _) in enumerate(pvt_blocks(model)) if s == last]


class PvtValueLabels(nn.Module):
    """*Value-path token labels* for a timm PVTv2 classifier: the PVTv2 analogue of
    :class:`~vitexplain.zoo.vit_signals.ValueLabels` and :class:`~vitexplain.zoo.hiera_signals.HieraValueLabels`.

    In each listed block of the last stage (default :func:`last_stage_blocks`; there the attention
    is global, without spatial reduction, when ``sr_ratio`` is 1) what key token j adds to the
    tokens it is attended from is its value through the output projection,
    ``o_j = W_proj (W_v LN_1(x_j) + b_v)`` (a (B, N, C) map; also what the gradient of an attention
    weight reads, ``dy / dA_ij = <dy / d out_i, o_j>``). The tokens then pass the stage's final
    LayerNorm and are mean-pooled into the linear head, so, to first order, ``o_j`` moves the
    logits by ``W_head (gamma * centre(o_j))`` (gamma: the stage norm's scale). This loss asks that
    per-key logit, times a learned positive scale (training-only, one per block) and with no bias,
    to predict the shape classes covering key j's image region (binary cross-entropy against the
    soft coverage at the last stage's stride, its positive term weighted by the batch's ratio of
    negative to positive coverage): positive for its own object's classes, negative for background
    and other objects. The model is meant to read each class from its own object's tokens, which
    is what class-discriminative attention maps (``generic``) report; the model is unchanged in form.

    Args:
        model: a timm ``PyramidVisionTransformerV2`` classifier.
        blocks: flat block indices (:func:`pvt_blocks`), all in the last stage (default
            :func:`last_stage_blocks`).

    Raises:
        UsageError: a listed block is not in the last stage or uses spatial reduction.
    """

    def __init__(self, model: nn.Module, blocks: Optional[Sequence[tuple[int, int]]] = None) -> None:
        super().__init__()
        self.model = [model]  # a list: not a submodule (its parameters are trained by the main group)
        self.blocks = last_stage_blocks(model) if blocks is None else [int(b) for b in blocks]
        where = pvt_blocks(model)
        for b in self.blocks:
            if b not in last_stage_blocks(model) or model.stages[where[b][0]].blocks[where[b][1]].attn.sr is not None:
                raise UsageError(f"value-path token labels need blocks of the last stage without spatial reduction "
                                 f"(flat indices {last_stage_blocks(model)}); got block {b}")
        self._where = [where[b] for b in self.blocks]
        self.log_scale = nn.Parameter(torch.zeros(len(self.blocks)))  # a positive scale: the sign is the model's
        self._tokens = Outputs({k: model.stages[s].blocks[i].norm1 for k, (s, i) in enumerate(self._where)})

    def remove(self) -> None:
        """Detach the hooks from the model."""
        self._tokens.remove()

    def per_key_logits(self, k: int) -> torch.Tensor:
        """The k-th listed block's per-key logits: (B, N, num_classes), keys in row-major order."""
        model = self.model[0]
        s, i = self._where[k]
        attn = model.stages[s].blocks[i].attn
        d = int(attn.proj.in_features)
        v_bias = None if attn.kv.bias is None else attn.kv.bias[d:]
        v = F.linear(self._tokens[k], attn.kv.weight[d:], v_bias)  # (B, N, C)
        o = F.linear(v, attn.proj.weight)
        o = o - o.mean(dim=-1, keepdim=True)
        return F.linear(o * model.stages[s].norm.weight, model.head.weight) * self.log_scale[k].exp()

    def forward(self, coverage: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """``coverage(g)``: the shape coverage of the batch the model has just run on, on a g x g grid
        ((B, C + 1, g, g), background last; ``patch_targets(batch, H // g)[0]``)."""
        losses = []
        for k in range(len(self.blocks)):
            z = self.per_key_logits(k)  # (B, N, C)
            g = int(round(z.shape[1] ** 0.5))
            if g * g != z.shape[1]:
                raise UsageError(f"value-path token labels need a square token grid, got {z.shape[1]} tokens")
            cover = coverage(g)[:, :-1].flatten(2).transpose(1, 2)  # (B, N, C), no background
            losses.append(balanced_bce(z, cover))
        return torch.stack(losses).mean()
