"""Training-only signals of the zoo recipes: extra heads, the hooks that feed them, initialisations.

None of this is saved with a model: the heads live beside it, and the hooks they put on it are
removed by :meth:`TrainingSignals.remove`, which :func:`vitexplain.zoo.train.train` calls in a
``finally`` block (also when training fails). See :mod:`vitexplain.zoo.recipes` for the recipes
that use them and why.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.synthetic import COLORS, SHAPES
from .evaluate import is_captioner
from .hiera_signals import HieraValueLabels
from .pvt_signals import PvtValueLabels
from .outputs import Outputs

__all__ = [
    "patch_targets",
    "AuxHeads",
    "DeepTokenLabels",
    "StageTokenLabels",
    "ValueLabels",
    "FeatureDistill",
    "TrainingSignals",
    "sincos_init",
    "mimetic_init",
]


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


class ValueLabels(nn.Module):
    """Training-only *value-path token labels* for a ViT classifier (used by the last stage).

    What a patch token i adds to the class token in the last block is its value projected by the
    attention's output projection, ``o_i = W_proj W_v T_i`` (T = the last block's first-norm
    output); what that does to the logits is, to first order, ``W_head (gamma * centre(o_i))``
    (gamma: the final norm's scale). This loss asks that per-token logit (with a learned scale
    and bias, training-only) to predict the shape classes covering patch i (binary cross-entropy
    against the soft coverage). The class token then reads each class from that class's own
    object tokens rather than from any object, which is the model behaviour that class-
    discriminative maps (CDAM, token Grad-CAM) report; the model itself is unchanged in form.
    """

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.vit = [vit]  # a list: not a submodule (its parameters are trained by the main group)
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.bias = nn.Parameter(torch.full((int(vit.num_classes),), -2.0))
        self._out = Outputs({"tokens": vit.blocks[-1].norm1})

    def remove(self) -> None:
        """Detach the hook from the model."""
        self._out.remove()

    def forward(self, targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        vit = self.vit[0]
        attn, dim = vit.blocks[-1].attn, int(vit.embed_dim)
        tokens = self._out["tokens"][:, vit.num_prefix_tokens:]
        o = F.linear(F.linear(tokens, attn.qkv.weight[2 * dim:]), attn.proj.weight)
        o = o - o.mean(dim=-1, keepdim=True)
        z = F.linear(o * vit.norm.weight, vit.head.weight) * self.scale + self.bias  # (B, N, C)
        cover = targets[0][:, :-1].flatten(2).transpose(1, 2)  # shape coverage, no background: (B, N, C)
        return F.binary_cross_entropy_with_logits(z, cover)


class FeatureDistill(nn.Module):
    """Training-only feature mimicking: a ViT block's patch tokens predict a trained CNN's 8 x 8 map.

    The teacher (``shapes-cnn``) sees the same image; its ``layer4`` output (B, C, 8, 8), normalised
    per position over channels, is the target of a linear map of the student's patch tokens after
    block ``block`` (MSE). This passes the CNN's locality to the ViT's early blocks; the saved ViT is
    unchanged (the projection and the teacher are not part of it).
    """

    def __init__(self, vit: nn.Module, teacher: nn.Module, block: int) -> None:
        super().__init__()
        self.teacher = [teacher.eval()]  # a list: not a submodule, not trained, not saved
        for p in teacher.parameters():
            p.requires_grad_(False)
        self.block = block
        chans = int(teacher.layer4[-1].conv2.out_channels)
        self.proj = nn.Linear(int(vit.embed_dim), chans)
        self._out = Outputs({"tokens": vit.blocks[block]})
        self.num_prefix = int(vit.num_prefix_tokens)

    def remove(self) -> None:
        """Detach the hook from the student."""
        self._out.remove()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        teacher = self.teacher[0]
        with torch.no_grad():
            feats: list[torch.Tensor] = []
            h = teacher.layer4.register_forward_hook(lambda m, a, o: feats.append(o))
            try:
                teacher(x)
            finally:
                h.remove()
            t = feats[0].flatten(2).transpose(1, 2)  # (B, 64, C)
            t = F.layer_norm(t, t.shape[-1:])
        pred = self.proj(self._out["tokens"][:, self.num_prefix:])
        return F.mse_loss(pred, t)


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


def sincos_init(vit: nn.Module) -> None:
    """Start a timm ViT's (learned) position embedding from 2-D sin-cos values (MAE-style).

    A locality prior that lets a small ViT learn from few images; the embedding stays learnable.
    """
    from timm.layers.pos_embed_sincos import build_sincos2d_pos_embed

    gh, gw = vit.patch_embed.grid_size
    table = build_sincos2d_pos_embed([gh, gw], int(vit.embed_dim))  # (gh * gw, D)
    with torch.no_grad():
        n_prefix = vit.pos_embed.shape[1] - gh * gw
        vit.pos_embed[0, n_prefix:] = table
        vit.pos_embed[0, :n_prefix] = 0.0


def mimetic_init(vit: nn.Module, generator: torch.Generator, alpha: tuple[float, float] = (0.7, 0.4),
                  beta: tuple[float, float] = (0.7, 0.4)) -> None:
    """Mimetic initialisation of a timm ViT's attention (Trockman & Kolter, ICML 2023).

    Per head, ``W_q W_k^T ~ alpha_1 Z + beta_1 I`` (tokens attend to similar tokens, hence with a
    sin-cos position embedding to their neighbours) and, per layer, ``W_v W_o ~ alpha_2 Z - beta_2 I``,
    as in pre-trained ViTs; ``Z`` is Gaussian with variance 1 / D. Speeds up small-data training.
    """
    for blk in vit.blocks:
        attn = blk.attn
        d = attn.qkv.in_features
        hd = d // attn.num_heads
        with torch.no_grad():
            for h in range(attn.num_heads):
                z = torch.randn(d, d, generator=generator) / d**0.5
                u, sv, vh = torch.linalg.svd(alpha[0] * z + beta[0] * torch.eye(d))
                root = sv[:hd].sqrt()
                attn.qkv.weight[h * hd:(h + 1) * hd] = (u[:, :hd] * root).T
                attn.qkv.weight[d + h * hd:d + (h + 1) * hd] = (vh[:hd].T * root).T
            z = torch.randn(d, d, generator=generator) / d**0.5
            u, sv, vh = torch.linalg.svd(alpha[1] * z - beta[1] * torch.eye(d))
            root = sv.sqrt()
            attn.qkv.weight[2 * d:] = (u * root).T  # v = x W_v^T
            attn.proj.weight.copy_((vh.T * root))  # out = v W_o^T, so W_v^T W_o^T = U S V^T
            if attn.qkv.bias is not None:
                attn.qkv.bias.zero_()
