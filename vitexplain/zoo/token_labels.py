"""Training-only token labeling of the zoo recipes: per-patch targets from the masks and the heads that predict them.

Token labeling (Jiang et al., "All Tokens Matter", NeurIPS 2021): every patch token also predicts what covers its
patch (shape class and colour, or background). :func:`patch_targets` turns a batch's ground-truth masks into those
soft targets; :class:`AuxHeads` predicts them from the final tokens, :class:`DeepTokenLabels` from inner blocks of a
ViT and :class:`StageTokenLabels` from the stages of a hierarchical model. None of this is saved with a model: the
heads live beside it and the hooks they put on it are removed by their ``remove`` (called by
:meth:`~vitexplain.zoo.signals.TrainingSignals.remove`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.drawing import COLORS
from .outputs import Outputs

__all__ = ["patch_targets", "AuxHeads", "DeepTokenLabels", "StageTokenLabels"]


def patch_targets(batch: Any, patch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft per-patch targets from the ground-truth masks (for token labeling).

    Args:
        batch: a :class:`~vitexplain.data.ShapesBatch`.
        patch: patch size of the ViT.

    Returns:
        ``(shape_t, color_t)``: (B, C + 1, gh, gw) and (B, K + 1, gh, gw) float32, the fraction of
        each patch covered by each shape class / color, background last; each sums to 1 per patch.
    """
    b = len(batch)
    h, w = batch.size
    n_s, n_c = batch.labels.shape[1], len(COLORS)
    cover_s = torch.zeros(b, n_s + 1, h, w)
    cover_c = torch.zeros(b, n_c + 1, h, w)
    for i in range(b):
        m = batch.masks[i].float()
        cover_s[i].index_add_(0, batch.classes[i], m)
        cover_c[i].index_add_(0, batch.colors[i], m)
    cover_s[:, -1] = 1.0 - cover_s[:, :-1].sum(1)
    cover_c[:, -1] = 1.0 - cover_c[:, :-1].sum(1)
    return F.avg_pool2d(cover_s, patch), F.avg_pool2d(cover_c, patch)


def _soft_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with soft targets; logits (B, N, K), target (B, K, gh, gw)."""
    t = target.flatten(2).transpose(1, 2)  # (B, N, K)
    return -(t * logits.log_softmax(-1)).sum(-1).mean()


class AuxHeads(nn.Module):
    """Training-only token-labeling heads on the patch tokens (not saved with the model).

    Token labeling (Jiang et al., "All Tokens Matter", NeurIPS 2021): every patch token also
    predicts what covers its patch (shape class and color, or background). This dense signal
    makes a small ViT learn from a few hundred thousand images instead of millions, and keeps
    the patch tokens local, which is what attention maps are read from.
    """

    def __init__(self, dim: int, num_shapes: int, num_colors: int) -> None:
        super().__init__()
        self.shape = nn.Linear(dim, num_shapes + 1)
        self.color = nn.Linear(dim, num_colors + 1)

    def forward(self, tokens: torch.Tensor, targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``targets``: the batch's :func:`patch_targets` (shape and color coverage)."""
        shape_t, color_t = targets
        return _soft_ce(self.shape(tokens), shape_t) + _soft_ce(self.color(tokens), color_t)


class DeepTokenLabels(nn.Module):
    """Token labeling on the outputs of inner blocks too (training-only, like :class:`AuxHeads`).

    Keeps every block's patch tokens about their own patch, so that the class token has to read
    class evidence from the tokens of the object itself (which is what gradient maps such as
    CDAM and token Grad-CAM then show). Each listed block gets a LayerNorm and its own heads.
    """

    def __init__(self, vit: nn.Module, blocks: Sequence[int], num_shapes: int, num_colors: int) -> None:
        super().__init__()
        dim = int(vit.embed_dim)
        self.blocks = list(blocks)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in self.blocks)
        self.heads = nn.ModuleList(AuxHeads(dim, num_shapes, num_colors) for _ in self.blocks)
        self.num_prefix = int(vit.num_prefix_tokens)
        self._out = Outputs({b: vit.blocks[b] for b in self.blocks})

    def remove(self) -> None:
        """Detach the hooks from the model."""
        self._out.remove()

    def forward(self, targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        losses = [head(norm(self._out[b][:, self.num_prefix:]), targets)
                  for b, norm, head in zip(self.blocks, self.norms, self.heads)]
        return torch.stack(losses).mean()


class StageTokenLabels(nn.Module):
    """Token labeling on the outputs of a hierarchical model's stages (training-only).

    The hierarchical counterpart of :class:`DeepTokenLabels` for the zoo's hierarchical models:
    each listed stage's output, a (B, C_s, h_s, w_s) map, gets a LayerNorm and its own heads, and
    predicts the shape and color coverage of the image region each of its tokens covers
    (``patch_targets`` at that stage's stride). Keeps every stage's tokens about their own region
    of the image. A PVTv2's stage outputs are read by forward hooks on ``model.stages``; a timm
    Hiera's (``shapes-hier``) are passed to :meth:`forward` (its ``forward_features`` returns them
    in row-major order with ``return_intermediates=True``), so no hook is needed.
    """

    def __init__(self, model: nn.Module, stages: Sequence[int], num_shapes: int, num_colors: int) -> None:
        super().__init__()
        self.stages = list(stages)
        if hasattr(model, "stage_ends"):  # timm Hiera
            dims = [int(model.blocks[model.stage_ends[s]].dim_out) for s in self.stages]
        else:
            dims = [int(model.stages[s].blocks[-1].norm1.normalized_shape[0]) for s in self.stages]
        self.norms = nn.ModuleList(nn.LayerNorm(d) for d in dims)
        self.heads = nn.ModuleList(AuxHeads(d, num_shapes, num_colors) for d in dims)
        self._out = Outputs({} if hasattr(model, "stage_ends") else {s: model.stages[s] for s in self.stages})

    def remove(self) -> None:
        """Detach the hooks from the model."""
        self._out.remove()

    def forward(self, batch: Any, outs: Optional[dict[int, torch.Tensor]] = None) -> torch.Tensor:
        """``outs``: stage index -> (B, C, h, w) output (default: what the hooks caught)."""
        outs = self._out if outs is None else outs
        losses = []
        for s, norm, head in zip(self.stages, self.norms, self.heads):
            out = outs[s]  # (B, C, h, w)
            targets = patch_targets(batch, batch.size[0] // out.shape[-2])
            losses.append(head(norm(out.flatten(2).transpose(1, 2)), targets))
        return torch.stack(losses).mean()
