"""The training-only signals of one zoo recipe stage, combined with the model's own objective.

:class:`TrainingSignals` builds the stage's heads (token labeling: :mod:`vitexplain.zoo.token_labels`; value-path
token labels and feature mimicking: :mod:`vitexplain.zoo.vit_signals`, :mod:`vitexplain.zoo.pvt_signals`,
:mod:`vitexplain.zoo.hiera_signals`) and computes the loss of one batch. None of this is saved with a model: the
heads live beside it, and the hooks they put on it are removed by :meth:`TrainingSignals.remove`, which
:func:`vitexplain.zoo.train.train` calls in a ``finally`` block (also when training fails). See
:mod:`vitexplain.zoo.recipes` for the recipes that use them and why.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.drawing import COLORS, SHAPES
from .evaluate import is_captioner
from .hiera_signals import HieraValueLabels
from .pvt_signals import PvtValueLabels
from .token_labels import AuxHeads, DeepTokenLabels, StageTokenLabels, patch_targets
from .vit_signals import FeatureDistill, ValueLabels

__all__ = ["TrainingSignals"]


class TrainingSignals(nn.Module):
    """The training-only heads of one stage, and the loss that combines them with the model's own.

    Built from the stage's weights: token labeling (``aux_weight``, on the final patch tokens and,
    with ``aux_blocks``, on those blocks' outputs), value-path token labels (``value_weight``, ViT
    classifiers) and feature mimicking of a trained teacher (``distill_weight``, ViT classifiers).
    The helpers that read intermediate tokens put forward hooks on the model; :meth:`remove` takes
    them all off (idempotent). If building one helper fails, the hooks of those already built are
    removed before the error propagates.

    Args:
        model: the model being trained (a timm ViT, the zoo CNN or the zoo captioner).
        arch: its zoo architecture (``"vit"``, ``"cnn"``, ``"pvt"``, ``"hiera"``, ``"captioner"``, ``"sat"``).
        aux_weight: weight of token labeling.
        aux_blocks: inner blocks whose outputs also get token labeling.
        value_weight: weight of the value-path token labels.
        value_blocks: Hiera and PVTv2: the blocks whose keys get them (empty: those at the head's width;
            PVTv2: flat block indices, :func:`~vitexplain.zoo.pvt_signals.pvt_blocks`).
        value_per_head: Hiera: label each head's share of a key's value on its own.
        distill_weight: weight of feature mimicking.
        teacher: loads the teacher model (called only when ``distill_weight > 0`` for a ViT).
        distill_block: the student block whose tokens mimic the teacher.
        label_smoothing: of the captioner's next-token cross-entropy.
        attention_reg: Show, Attend and Tell (``shapes-sat``): weight of the doubly stochastic
            attention penalty.
    """

    def __init__(self, model: nn.Module, arch: str, *, aux_weight: float = 0.0, aux_blocks: Sequence[int] = (),
                 value_weight: float = 0.0, value_blocks: Sequence[int] = (),
                 value_per_head: bool = False, distill_weight: float = 0.0,
                 teacher: Any = None, distill_block: int = 1, label_smoothing: float = 0.0,
                 attention_reg: float = 0.0) -> None:
        super().__init__()
        self.aux_weight, self.value_weight, self.distill_weight = aux_weight, value_weight, distill_weight
        self.label_smoothing, self.attention_reg = label_smoothing, attention_reg
        self.arch = arch
        self.aux: Optional[AuxHeads] = None
        self.deep: Optional[DeepTokenLabels | StageTokenLabels] = None
        self.value: Optional[nn.Module] = None  # ValueLabels, PvtValueLabels or HieraValueLabels
        self.distill: Optional[FeatureDistill] = None
        vit = model.encoder if is_captioner(model) else model
        try:  # the order of construction fixes the random initialisation of the heads
            if aux_weight > 0:
                dim = int(vit.num_features if arch in ("pvt", "hiera") else vit.embed_dim)
                self.aux = AuxHeads(dim, len(SHAPES), len(COLORS))
                if aux_blocks and arch in ("pvt", "hiera"):  # stage indices
                    self.deep = StageTokenLabels(vit, aux_blocks, len(SHAPES), len(COLORS))
                elif aux_blocks:
                    self.deep = DeepTokenLabels(vit, aux_blocks, len(SHAPES), len(COLORS))
            if value_weight > 0 and arch == "vit":
                self.value = ValueLabels(model)
            elif value_weight > 0 and arch == "pvt":
                self.value = PvtValueLabels(model, tuple(value_blocks) or None)
            elif value_weight > 0 and arch == "hiera":
                self.value = HieraValueLabels(model, tuple(value_blocks) or None, value_per_head)
            if distill_weight > 0 and arch == "vit":
                self.distill = FeatureDistill(model, teacher(), distill_block)
        except BaseException:
            self.remove()
            raise

    def head_parameters(self) -> list[nn.Parameter]:
        """The heads' trainable parameters, in the order the optimiser's first group takes them."""
        params: list[nn.Parameter] = []
        for part in (self.aux, self.deep, self.value):
            if part is not None:
                params += list(part.parameters())
        if self.distill is not None:
            params += list(self.distill.proj.parameters())
        return params

    def remove(self) -> None:
        """Take every hook these heads put on the model off it (safe to call twice)."""
        for part in (self.deep, self.value, self.distill):
            if part is not None and hasattr(part, "remove"):
                part.remove()

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The training loss of one batch: the model's own objective plus the weighted signals.

        Args:
            model: the model being trained.
            batch: a :class:`~vitexplain.data.ShapesBatch`.

        Returns:
            The scalar loss.
        """
        x = batch.tensor
        if hasattr(model, "run_decoder"):  # shapes-sat
            return self._sat_loss(model, batch)
        if self.arch == "pvt":
            return self._pvt_loss(model, batch)
        if self.arch == "hiera":  # shapes-hier
            return self._hiera_loss(model, batch)
        if is_captioner(model):
            seq = model.tokenize(batch.captions)
            memory = model.encode(x)
            logits = model.decode_step(seq[:, :-1], memory)
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1), ignore_index=model.vocab.pad_id,
                label_smoothing=self.label_smoothing,
            )
            vit, tokens = model.encoder, memory
        elif hasattr(model, "forward_features") and hasattr(model, "num_prefix_tokens"):  # timm ViT
            tokens = model.forward_features(x)
            loss = F.binary_cross_entropy_with_logits(model.forward_head(tokens), batch.labels)
            vit = model
        else:
            return F.binary_cross_entropy_with_logits(model(x), batch.labels)
        if self.aux is not None or self.value is not None:  # the per-patch targets, once per batch
            targets = patch_targets(batch, int(vit.patch_embed.patch_size[0]))
        if self.aux is not None:
            loss = loss + self.aux_weight * self.aux(tokens[:, vit.num_prefix_tokens:], targets)
            if self.deep is not None:
                loss = loss + self.aux_weight * self.deep(targets)
        if self.value is not None:
            loss = loss + self.value_weight * self.value(targets)
        if self.distill is not None:
            loss = loss + self.distill_weight * self.distill(x)
        return loss


    def _pvt_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """PVTv2 (``shapes-hier --arch pvt``): binary cross-entropy plus token labeling of the last stage's
        tokens (``aux_weight``), of the listed stages' outputs (``aux_blocks``: stage indices) and
        value-path token labels (``value_weight``, :class:`~vitexplain.zoo.pvt_signals.PvtValueLabels`)."""
        feats = model.forward_features(batch.tensor)  # (B, C, h, w)
        loss = F.binary_cross_entropy_with_logits(model.forward_head(feats), batch.labels)
        if self.aux is not None:
            targets = patch_targets(batch, batch.size[0] // feats.shape[-2])
            loss = loss + self.aux_weight * self.aux(feats.flatten(2).transpose(1, 2), targets)
            if self.deep is not None:
                loss = loss + self.aux_weight * self.deep(batch)
        if self.value is not None:
            loss = loss + self.value_weight * self.value(lambda g: patch_targets(batch, batch.size[0] // g)[0])
        return loss

    def _hiera_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """timm Hiera (``shapes-hier``): binary cross-entropy plus token labeling of the last stage's
        tokens (``aux_weight``, layer-normalised without affine: the model's own norm comes after its
        average pooling), of the listed stages' outputs (``aux_blocks``: stage indices) and value-path
        token labels (``value_weight``, :class:`~vitexplain.zoo.hiera_signals.HieraValueLabels`)."""
        feats, stages = model.forward_features(batch.tensor, return_intermediates=True)  # stages: (B, h, w, C)
        loss = F.binary_cross_entropy_with_logits(model.forward_head(feats), batch.labels)
        if self.aux is not None:
            last = stages[-1]
            targets = patch_targets(batch, batch.size[0] // last.shape[1])
            tokens = F.layer_norm(last.flatten(1, 2), last.shape[-1:])
            loss = loss + self.aux_weight * self.aux(tokens, targets)
            if self.deep is not None:
                outs = {s: stages[s].permute(0, 3, 1, 2) for s in self.deep.stages}
                loss = loss + self.aux_weight * self.deep(batch, outs)
        if self.value is not None:
            loss = loss + self.value_weight * self.value(lambda g: patch_targets(batch, batch.size[0] // g)[0])
        return loss

    def _sat_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Show, Attend and Tell's loss (Xu et al. 2015, eq. 14), averaged over the batch.

        ``-log P(caption | image)`` (summed over the caption's words, ``<eos>`` included) plus
        ``attention_reg * sum_i (1 - sum_t alpha_ti)^2`` over the N grid locations, plus token
        labeling of the annotation vectors (``aux_weight``).
        """
        from .sat import doubly_stochastic

        seq = model.tokenize(batch.captions)
        annotations = model.encode(batch.tensor)
        logits, alphas = model.run_decoder(annotations, seq[:, :-1])
        target = seq[:, 1:]
        pad = model.vocab.pad_id
        nll = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=pad, reduction="none").sum(1)
        loss = (nll + self.attention_reg * doubly_stochastic(alphas, target != pad)).mean()
        if self.aux is not None:
            loss = loss + self.aux_weight * self.aux(annotations, patch_targets(batch, model.encoder.stride))
        return loss
