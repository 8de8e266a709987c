"""Train a zoo model on freshly generated shapes images.

Usage::

    python -m vitexplain.zoo.train shapes-cnn --out vitexplain/zoo/weights --threads 1
    python -m vitexplain.zoo.train shapes-vit --out vitexplain/zoo/weights --threads 1  # needs shapes-cnn
    python -m vitexplain.zoo.train shapes-captioner --out vitexplain/zoo/weights --threads 1  # needs shapes-vit
    python -m vitexplain.zoo.train shapes-sat --out vitexplain/zoo/weights --threads 1
    python -m vitexplain.zoo.train NAME --out DIR --steps N [--resume CKPT.json]  # one stage, overrides

The first four commands reproduce the bundled weights (in this order: the ViT mimics the CNN's
features, the captioner starts from the ViT; ``shapes-sat`` starts from scratch); a run without ``--steps/--batch-size/--lr/--resume``
follows the model's full recipe (all stages).

Every step draws a new batch from the synthetic generator, so no image is seen twice and there
is nothing to overfit to. Seeds (see also :mod:`vitexplain.zoo.evaluate`):

* training images: stream ``seed = --seed`` (must be ``< 9_000``), images
  ``step * batch_size .. (step + 1) * batch_size - 1``;
* validation printed during training: seed ``9_000`` (``VAL_SEED``);
* evaluation (tests, ``benchmarks/zoo_accuracy.py``, the metrics written into the config):
  seeds ``>= 10_000`` (``EVAL_SEED``), never used for training.

Recipes (:data:`RECIPES`): AdamW with warmup and cosine decay, gradient clipping at 1.0.

* ``shapes-vit``: binary cross-entropy on the class token's logits, plus two training-only
  signals that make a small ViT learn from ~10^5 images instead of millions (the saved model is
  a plain timm ``VisionTransformer``; the extra heads are dropped):

  - *token labeling* (Jiang et al., NeurIPS 2021): linear heads on the final patch tokens predict
    the soft shape-class and color coverage of each patch (background included);
  - *feature mimicking* of the trained ``shapes-cnn``: a linear map of the patch tokens after
    block 1 predicts the CNN's (layer-normalised) ``layer4`` features on the same 8 x 8 grid.

  Initialisation: 2-D sin-cos position embedding (still learned) and mimetic attention
  initialisation (Trockman & Kolter, ICML 2023). Five stages, each resumed from the previous one
  on new images (seed ``s + k - 1`` for stage k): 4,000 steps x 32 images at lr 1e-3; 3,000 x 64
  at 5e-4; then three short stages at 3e-4 that shape *where* the class evidence is read from:
  token labeling also on block 2's output (the tokens entering the last block; 750 steps), then
  *value-path token labels* (``_ValueLabels``: what each patch token's value adds to the logits
  through the last attention must predict that patch's own classes; weight 2, then 4; 1,500 steps
  each). Without the last two, the ViT is as accurate but reads a shape's class partly from the
  other objects' tokens, so class-discriminative maps (CDAM, token Grad-CAM) point at the wrong
  object in 15-25% of two-object images; with them >= 90% point at the right one.
* ``shapes-cnn``: binary cross-entropy.
* ``shapes-captioner``: next-token cross-entropy (teacher forcing) plus the same token labeling
  on the encoder; the encoder starts from the trained ``shapes-vit`` trunk (``--init-encoder``,
  default: the bundled checkpoint), the decoder from scratch.

* ``shapes-sat`` (Show, Attend and Tell, :mod:`vitexplain.zoo.sat`), from scratch: the paper's loss
  (Xu et al. 2015, eq. 14), ``-log P(caption | image)`` summed over the words plus the doubly
  stochastic attention regularisation ``lambda * sum_i (1 - sum_t alpha_ti)^2`` (``attention_reg``
  = lambda), plus the same token labeling on the encoder's grid (the paper's encoder was a
  pretrained VGG; this one learns from the shapes alone). The attention itself is never supervised.
  Three choices decide whether each word's attention lies on the object it names (per-word
  pointing on fresh images, seeds 20,000 / 30,000): lambda = 0.02, not 0.1 (the penalty wants each
  of the grid's locations covered about once over a ~6-word caption, which drew the shape words'
  attention off the objects: 0.52 vs 0.91 after 600 steps); dropout 0.5 on the context where it
  enters the LSTM (``context_dropout``; without it the memory carries an object's features from
  its colour word to its shape word, which then attends elsewhere: 0.60 vs 0.89 after 1,500 steps);
  and a stride-4 grid (16 x 16; on an 8 x 8 grid the colour words peaked one cell off the object's
  edge: 0.89 vs 0.96).

Training is deterministic given ``--seed`` (and, for the captioner, the encoder it starts from)
on the same machine, thread count and library versions: ``torch.manual_seed(seed)`` fixes the
initialisation and the data stream is fixed. It uses torch's default thread count (all cores)
unless ``--threads`` says otherwise. The script prints progress and, at the end, the CPU time
(``time.process_time``, summed over threads) and wall time; both are stored in the JSON config
under ``training``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.synthetic import COLORS, SHAPES, shapes
from .evaluate import EVAL_SEED, VAL_SEED, evaluate, is_captioner
from .hub import names, save_checkpoint
from .models import DEFAULT_CONFIGS, build
from ..errors import UsageError, NotFoundError

__all__ = ["RECIPES", "train", "train_schedule", "main"]

#: Optimisation recipe per model: steps, batch size, peak learning rate, weight decay, warmup.
#: ``aux_weight`` is the weight of the token-labeling loss (ViTs only; see ``_AuxHeads``),
#: ``distill_weight`` the weight of feature mimicking of ``distill_from`` (see ``_FeatureDistill``).
#: ``then`` lists further stages (:func:`train_schedule`): each resumes from the previous stage's
#: weights with fresh optimiser state, its own steps / batch size / lr, and training seed
#: ``seed + seed_offset`` (new images).
RECIPES: dict[str, dict[str, Any]] = {
    "shapes-vit": {"steps": 4000, "batch_size": 32, "lr": 1e-3, "weight_decay": 0.05, "warmup": 200,
                   "aux_weight": 0.5, "attn_init": "mimetic",
                   "distill_weight": 1.0, "distill_from": "shapes-cnn", "distill_block": 1,
                   "then": [{"steps": 3000, "batch_size": 64, "lr": 5e-4, "seed_offset": 1},
                            {"steps": 750, "batch_size": 64, "lr": 3e-4, "seed_offset": 2, "aux_blocks": [2]},
                            {"steps": 1500, "batch_size": 64, "lr": 3e-4, "seed_offset": 3, "aux_blocks": [2],
                             "value_weight": 2.0},
                            {"steps": 1500, "batch_size": 64, "lr": 3e-4, "seed_offset": 4, "aux_blocks": [2],
                             "value_weight": 4.0}]},
    "shapes-cnn": {"steps": 1500, "batch_size": 64, "lr": 2e-3, "weight_decay": 0.01, "warmup": 75,
                   "aux_weight": 0.0},
    "shapes-captioner": {"steps": 2000, "batch_size": 64, "lr": 5e-4, "weight_decay": 0.05, "warmup": 100,
                         "aux_weight": 0.5, "init_encoder": "shapes-vit"},
    # Show, Attend and Tell: the caption's negative log-likelihood + doubly stochastic attention
    # regularisation (weight ``attention_reg``, see ``_sat_loss``) + token labeling on the CNN grid.
    "shapes-sat": {"steps": 1500, "batch_size": 64, "lr": 2e-3, "weight_decay": 0.01, "warmup": 100,
                   "aux_weight": 0.5, "attention_reg": 0.02},
}
MAX_TRAIN_SEED = 9_000


def _lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 2% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t))))


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases, norms, embeddings and tokens."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or n.endswith(("pos_embed", "cls_token", "pos")) or "embed.weight" == n:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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


class _AuxHeads(nn.Module):
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


class _DeepTokenLabels(nn.Module):
    """Token labeling on the outputs of inner blocks too (training-only, like :class:`_AuxHeads`).

    Keeps every block's patch tokens about their own patch, so that the class token has to read
    class evidence from the tokens of the object itself (which is what gradient maps such as
    CDAM and token Grad-CAM then show). Each listed block gets a LayerNorm and its own heads.
    """

    def __init__(self, vit: nn.Module, blocks: Sequence[int], num_shapes: int, num_colors: int) -> None:
        super().__init__()
        dim = int(vit.embed_dim)
        self.blocks = list(blocks)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in self.blocks)
        self.heads = nn.ModuleList(_AuxHeads(dim, num_shapes, num_colors) for _ in self.blocks)
        self.num_prefix = int(vit.num_prefix_tokens)
        self._out: dict[int, torch.Tensor] = {}
        self._hooks = [vit.blocks[b].register_forward_hook(self._grabber(b)) for b in self.blocks]

    def _grabber(self, b: int) -> Any:
        def grab(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            self._out[b] = out
        return grab

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self._hooks:
            h.remove()

    def forward(self, targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        losses = [head(norm(self._out[b][:, self.num_prefix:]), targets)
                  for b, norm, head in zip(self.blocks, self.norms, self.heads)]
        return torch.stack(losses).mean()


class _ValueLabels(nn.Module):
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
        self._tokens: Optional[torch.Tensor] = None
        self._hook = vit.blocks[-1].norm1.register_forward_hook(self._grab)

    def remove(self) -> None:
        """Detach the hook from the model."""
        self._hook.remove()

    def _grab(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        self._tokens = out

    def forward(self, targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        vit = self.vit[0]
        attn, dim = vit.blocks[-1].attn, int(vit.embed_dim)
        tokens = self._tokens[:, vit.num_prefix_tokens:]
        o = F.linear(F.linear(tokens, attn.qkv.weight[2 * dim:]), attn.proj.weight)
        o = o - o.mean(dim=-1, keepdim=True)
        z = F.linear(o * vit.norm.weight, vit.head.weight) * self.scale + self.bias  # (B, N, C)
        cover = targets[0][:, :-1].flatten(2).transpose(1, 2)  # shape coverage, no background: (B, N, C)
        return F.binary_cross_entropy_with_logits(z, cover)


class _FeatureDistill(nn.Module):
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
        self._tokens: Optional[torch.Tensor] = None
        self._hook = vit.blocks[block].register_forward_hook(self._grab)
        self.num_prefix = int(vit.num_prefix_tokens)

    def remove(self) -> None:
        """Detach the hook from the student."""
        self._hook.remove()

    def _grab(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        self._tokens = out

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
        pred = self.proj(self._tokens[:, self.num_prefix:])
        return F.mse_loss(pred, t)


def _sat_loss(model: nn.Module, batch: Any, aux: Optional[_AuxHeads], aux_weight: float,
              attention_reg: float) -> torch.Tensor:
    """Show, Attend and Tell's loss (Xu et al. 2015, eq. 14), averaged over the batch.

    ``-log P(caption | image)`` (summed over the caption's words, ``<eos>`` included) plus
    ``attention_reg * sum_i (1 - sum_t alpha_ti)^2`` over the N grid locations, plus token
    labeling of the annotation vectors (``aux_weight``, training-only heads).
    """
    from .sat import doubly_stochastic

    seq = model.tokenize(batch.captions)
    annotations = model.encode(batch.tensor)
    logits, alphas = model.run_decoder(annotations, seq[:, :-1])
    target = seq[:, 1:]
    pad = model.vocab.pad_id
    nll = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=pad, reduction="none").sum(1)
    loss = (nll + attention_reg * doubly_stochastic(alphas, target != pad)).mean()
    if aux is not None and aux_weight > 0:
        loss = loss + aux_weight * aux(annotations, patch_targets(batch, model.encoder.stride))
    return loss


def _loss(model: nn.Module, batch: Any, aux: Optional[_AuxHeads], aux_weight: float,
          distill: Optional[_FeatureDistill] = None, distill_weight: float = 0.0,
          deep: Optional[_DeepTokenLabels] = None, value: Optional[_ValueLabels] = None,
          value_weight: float = 0.0, label_smoothing: float = 0.0, attention_reg: float = 0.0) -> torch.Tensor:
    x = batch.tensor
    if hasattr(model, "run_decoder"):  # shapes-sat
        return _sat_loss(model, batch, aux, aux_weight, attention_reg)
    if is_captioner(model):
        seq = model.tokenize(batch.captions)
        memory = model.encode(x)
        logits = model.decode_step(seq[:, :-1], memory)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1), ignore_index=model.vocab.pad_id,
            label_smoothing=label_smoothing,
        )
        vit, tokens = model.encoder, memory
    elif hasattr(model, "forward_features") and hasattr(model, "num_prefix_tokens"):  # timm ViT
        tokens = model.forward_features(x)
        loss = F.binary_cross_entropy_with_logits(model.forward_head(tokens), batch.labels)
        vit = model
    else:
        return F.binary_cross_entropy_with_logits(model(x), batch.labels)
    use_aux = aux is not None and aux_weight > 0
    use_value = value is not None and value_weight > 0
    if use_aux or use_value:  # the per-patch targets, once per batch for every head
        targets = patch_targets(batch, int(vit.patch_embed.patch_size[0]))
    if use_aux:
        loss = loss + aux_weight * aux(tokens[:, vit.num_prefix_tokens:], targets)
        if deep is not None:
            loss = loss + aux_weight * deep(targets)
    if use_value:
        loss = loss + value_weight * value(targets)
    if distill is not None and distill_weight > 0:
        loss = loss + distill_weight * distill(x)
    return loss


def _sincos_init(vit: nn.Module) -> None:
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


def _mimetic_init(vit: nn.Module, generator: torch.Generator, alpha: tuple[float, float] = (0.7, 0.4),
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


def _resume(model: nn.Module, path: str, name: str, log: Any) -> dict[str, Any]:
    """Start from the weights of an earlier checkpoint of the same model (a further training stage).

    Returns:
        The earlier checkpoint's ``training`` record (kept in the new config under ``previous``).
    """
    from safetensors.torch import load_file

    p = Path(path)
    with open(p.with_suffix(".json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("name") != name or cfg.get("model_args") != DEFAULT_CONFIGS[name]["model_args"]:
        raise UsageError(f"{p} is not a {name} checkpoint with the current architecture")
    model.load_state_dict(load_file(str(p.with_suffix(".safetensors"))), strict=True)
    log(f"[{name}] resumed weights from {p} ({cfg['training'].get('images_seen')} images seen)")
    return cfg["training"]


def _init_encoder(model: nn.Module, source: str, log: Any) -> None:
    """Copy a trained zoo ViT's trunk (all but its head) into the captioner's encoder.

    Args:
        model: the captioner.
        source: a zoo name (bundled weights) or the path of a checkpoint ``.json``.
        log: print function.
    """
    from .hub import load, load_checkpoint

    vit = load(source) if source in names() else load_checkpoint(source)
    state = {k: v for k, v in vit.state_dict().items() if not k.startswith("head.")}
    missing, unexpected = model.encoder.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("head") for k in missing):
        raise UsageError(f"{source} does not match the captioner encoder: missing {missing}, "
                         f"unexpected {unexpected}")
    log(f"[{getattr(vit, 'zoo_name', source)}] trunk copied into the captioner encoder")


def _fmt(metrics: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def train(
    name: str,
    out: str | Path,
    seed: int = 0,
    steps: Optional[int] = None,
    batch_size: Optional[int] = None,
    lr: Optional[float] = None,
    log_every: int = 50,
    eval_every: int = 500,
    val_images: int = 512,
    final_eval_images: int = 1000,
    aux_weight: Optional[float] = None,
    init_encoder: Optional[str] = "default",
    distill_weight: Optional[float] = None,
    resume: Optional[str] = None,
    aux_blocks: Optional[Sequence[int]] = None,
    value_weight: Optional[float] = None,
    label_smoothing: Optional[float] = None,
    log: Any = print,
) -> Path:
    """Train one zoo model from scratch and write its checkpoint.

    Args:
        name: one of :func:`vitexplain.zoo.names`.
        out: output folder; ``<name>.safetensors`` and ``<name>.json`` are written there.
        seed: training seed (``0 <= seed < 9_000``): initialisation and training-image stream.
        steps: optimisation steps (default: the recipe's).
        batch_size: images per step (default: the recipe's).
        lr: peak learning rate (default: the recipe's).
        log_every: print the running loss every this many steps.
        eval_every: print validation accuracy (seed 9_000) every this many steps (0: never).
        val_images: validation images per check.
        final_eval_images: held-out images (seed 10_000) scored at the end and stored in the
            config (0: skip).
        aux_weight: weight of the token-labeling loss (default: the recipe's; ViTs only).
        init_encoder: captioner only: initialise the encoder from this trained ViT (a zoo name
            or a checkpoint ``.json``); ``"default"``: the recipe's (the bundled ``shapes-vit``);
            None or ``"none"``: random init.
        distill_weight: ViT only: weight of feature mimicking of ``shapes-cnn`` (default: recipe).
        resume: start from this checkpoint (``.json``) of the same model instead of a fresh
            initialisation: a further training stage (use another ``seed`` so it sees new images).
        aux_blocks: ViTs: also apply token labeling to the outputs of these blocks (default:
            the recipe's ``aux_blocks``, none).
        value_weight: ViT only: weight of the value-path token labels (``_ValueLabels``;
            default: the recipe's, 0).
        label_smoothing: captioner only: label smoothing of the next-token cross-entropy
            (default: the recipe's, 0).
        log: print function.

    Returns:
        Path of the written JSON config.
    """
    if name not in DEFAULT_CONFIGS:
        raise NotFoundError(f"unknown zoo model {name!r}; available: {', '.join(names())}")
    if not 0 <= seed < MAX_TRAIN_SEED:
        raise UsageError(f"training seeds are 0..{MAX_TRAIN_SEED - 1} (higher seeds are held out)")
    recipe = dict(RECIPES[name])
    steps = int(steps if steps is not None else recipe["steps"])
    batch_size = int(batch_size or recipe["batch_size"])
    peak_lr = float(lr or recipe["lr"])
    warmup = min(int(recipe["warmup"]), max(1, steps // 10))

    torch.manual_seed(seed)
    config: dict[str, Any] = {"name": name, **DEFAULT_CONFIGS[name]}
    model = build(config)
    init_from = recipe.get("init_encoder") if init_encoder == "default" else init_encoder
    previous: Optional[dict[str, Any]] = None
    if resume:
        previous = _resume(model, resume, name, log)
    elif is_captioner(model) and init_from:
        _init_encoder(model, init_from, log)
    elif config["arch"] in ("vit", "captioner"):
        vit = model.encoder if is_captioner(model) else model
        _sincos_init(vit)
        if recipe.get("attn_init") == "mimetic":
            _mimetic_init(vit, torch.Generator().manual_seed(seed))
    model.train()
    aux_weight = float(recipe["aux_weight"] if aux_weight is None else aux_weight)
    aux: Optional[_AuxHeads] = None
    groups = _param_groups(model, recipe["weight_decay"])
    if aux_weight > 0:
        vit = model.encoder if is_captioner(model) else model
        aux = _AuxHeads(int(vit.embed_dim), len(SHAPES), len(COLORS))
        groups[0]["params"] += list(aux.parameters())
    deep: Optional[_DeepTokenLabels] = None
    aux_blocks = list(recipe.get("aux_blocks", []) if aux_blocks is None else aux_blocks)
    if aux is not None and aux_blocks:
        deep = _DeepTokenLabels(model.encoder if is_captioner(model) else model, aux_blocks,
                                len(SHAPES), len(COLORS))
        groups[0]["params"] += list(deep.parameters())
    label_smoothing = float(recipe.get("label_smoothing", 0.0) if label_smoothing is None else label_smoothing)
    attention_reg = float(recipe.get("attention_reg", 0.0))
    value: Optional[_ValueLabels] = None
    value_weight = float(recipe.get("value_weight", 0.0) if value_weight is None else value_weight)
    if value_weight > 0 and config["arch"] == "vit":
        value = _ValueLabels(model)
        groups[0]["params"] += list(value.parameters())
    distill: Optional[_FeatureDistill] = None
    distill_weight = float(recipe.get("distill_weight", 0.0) if distill_weight is None else distill_weight)
    if distill_weight > 0 and config["arch"] == "vit":
        from .hub import load as _load_zoo

        distill = _FeatureDistill(model, _load_zoo(recipe["distill_from"]), int(recipe["distill_block"]))
        groups[0]["params"] += list(distill.proj.parameters())
    opt = torch.optim.AdamW(groups, lr=peak_lr, betas=(0.9, 0.999))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[{name}] {n_params / 1e6:.3f}M params, {steps} steps x {batch_size} images, lr {peak_lr:g}, "
        f"seed {seed}, {torch.get_num_threads()} threads")

    cpu0, wall0 = time.process_time(), time.perf_counter()
    data_time = 0.0
    running = 0.0
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, peak_lr, warmup)
        t0 = time.perf_counter()
        batch = shapes(batch_size, seed=seed, start=step * batch_size)
        data_time += time.perf_counter() - t0
        loss = _loss(model, batch, aux, aux_weight, distill, distill_weight, deep, value, value_weight,
                     label_smoothing, attention_reg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        running = loss.item() if step == 0 else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            wall = time.perf_counter() - wall0
            log(f"[{name}] step {step + 1}/{steps} loss {running:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{(step + 1) * batch_size / wall:.0f} img/s wall {wall:.0f}s")
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            log(f"[{name}] val@{step + 1} (seed {VAL_SEED}): {_fmt(evaluate(model, val_images, VAL_SEED))}")

    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    if distill is not None:
        distill.remove()
    if deep is not None:
        deep.remove()
    if value is not None:
        value.remove()
    model.eval()
    metrics: dict[str, Any] = {}
    if val_images:
        metrics["val"] = {"seed": VAL_SEED, **evaluate(model, val_images, VAL_SEED)}
        log(f"[{name}] val (seed {VAL_SEED}): {_fmt(metrics['val'])}")
    if final_eval_images:
        metrics["eval"] = {"seed": EVAL_SEED, **evaluate(model, final_eval_images, EVAL_SEED)}
        log(f"[{name}] held-out (seed {EVAL_SEED}): {_fmt(metrics['eval'])}")
    config["training"] = {
        "command": f"python -m vitexplain.zoo.train {name} --out DIR --seed {seed} --steps {steps}",
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "images_seen": steps * batch_size,
        "lr": peak_lr,
        "weight_decay": recipe["weight_decay"],
        "attn_init": recipe.get("attn_init") if config["arch"] == "vit" else None,
        "aux_weight": aux_weight,
        "aux_blocks": aux_blocks if deep is not None else None,
        "value_weight": value_weight if value is not None else None,
        "label_smoothing": label_smoothing if is_captioner(model) else None,
        "distill": f"{recipe['distill_from']} layer4 -> block {recipe['distill_block']} tokens, "
                   f"weight {distill_weight}" if distill is not None else None,
        "init_encoder": init_from if is_captioner(model) else None,
        "pos_embed_init": "2d sincos" if config["arch"] == "vit" or (config["arch"] == "captioner" and not init_from)
        else None,
        "attention_reg": f"doubly stochastic attention, weight {attention_reg}" if attention_reg else None,
        "aux_loss": "token labeling: soft CE of per-patch shape/color coverage (training-only heads)"
        if aux_weight > 0 else None,
        "warmup": warmup,
        "optimizer": "AdamW, cosine schedule, grad clip 1.0",
        "train_data": f"vx.data.shapes(batch_size, seed={seed}, start=step*batch_size)",
        "cpu_time_s": round(cpu_s, 1),
        "wall_time_s": round(wall_s, 1),
        "data_time_s": round(data_time, 1),
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "timm": _timm_version(),
    }
    if previous is not None:
        config["training"]["previous"] = previous
        config["training"]["images_seen_total"] = steps * batch_size + int(
            previous.get("images_seen_total", previous.get("images_seen", 0)))
        config["training"]["cpu_time_s_total"] = round(cpu_s + float(
            previous.get("cpu_time_s_total", previous.get("cpu_time_s", 0.0))), 1)
        config["training"]["command"] += f" --resume {Path(resume).name}"
    config["metrics"] = metrics
    path = save_checkpoint(model, config, out)
    log(f"[{name}] done: CPU time {cpu_s:.0f}s ({cpu_s / 60:.1f} min, {torch.get_num_threads()} threads), "
        f"wall {wall_s:.0f}s; wrote {path} and {path.with_suffix('.safetensors')}")
    return path


def train_schedule(name: str, out: str | Path, seed: int = 0, log: Any = print, **kwargs: Any) -> Path:
    """Run a model's whole recipe: the first stage, then every stage in ``RECIPES[name]["then"]``.

    Intermediate checkpoints go to ``out/stages/<k>/``; the last stage writes ``out/<name>.json``
    with the earlier stages' records nested under ``training.previous``.

    Args:
        name: zoo model name.
        out: output folder.
        seed: training seed of the first stage.
        log: print function.
        **kwargs: passed to every :func:`train` call (``log_every``, ``eval_every``, ...).

    Returns:
        Path of the final JSON config.
    """
    stages = RECIPES[name].get("then", [])
    if not stages:
        return train(name, out, seed=seed, log=log, **kwargs)
    out = Path(out)
    first = dict(kwargs, final_eval_images=0)
    path = train(name, out / "stages" / "1", seed=seed, log=log, **first)
    for k, stage in enumerate(stages, start=2):
        last = k == len(stages) + 1
        stage_kwargs = dict(kwargs if last else first)
        for key in ("distill_weight", "aux_blocks", "value_weight"):  # per-stage overrides of the recipe
            if key in stage and stage_kwargs.get(key) is None:
                stage_kwargs[key] = stage[key]
        path = train(
            name, out if last else out / "stages" / str(k), seed=seed + int(stage.get("seed_offset", k - 1)),
            steps=stage["steps"], batch_size=stage["batch_size"], lr=stage["lr"], resume=str(path),
            log=log, **stage_kwargs,
        )
    return path


def _timm_version() -> str:
    import timm

    return str(timm.__version__)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m vitexplain.zoo.train", description=__doc__.split("\n")[0])
    p.add_argument("name", choices=names())
    p.add_argument("--out", required=True, help="output folder for <name>.safetensors and <name>.json")
    p.add_argument("--seed", type=int, default=0, help=f"training seed, 0..{MAX_TRAIN_SEED - 1}")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--val-images", type=int, default=512)
    p.add_argument("--final-eval-images", type=int, default=1000)
    p.add_argument("--aux-weight", type=float, default=None, help="token-labeling loss weight (ViTs)")
    p.add_argument("--init-encoder", default="default",
                   help="captioner: trained ViT to start the encoder from (zoo name or checkpoint .json; "
                        "'none' for random init; default: the bundled shapes-vit)")
    p.add_argument("--distill-weight", type=float, default=None,
                   help="ViT: weight of feature mimicking of the trained shapes-cnn (default: the recipe's)")
    p.add_argument("--aux-blocks", default=None,
                   help="ViTs: comma-separated block indices whose outputs also get token labeling")
    p.add_argument("--value-weight", type=float, default=None,
                   help="ViT: weight of the value-path token labels of the last block (default: the recipe's)")
    p.add_argument("--label-smoothing", type=float, default=None,
                   help="captioner: label smoothing of the next-token loss (default: the recipe's)")
    p.add_argument("--resume", default=None,
                   help="a further training stage: start from this checkpoint (.json) of the same model")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's default, all cores); on a machine shared with "
                        "other jobs, 1 thread per training run is faster than oversubscribed threads")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    common = dict(
        log_every=a.log_every, eval_every=a.eval_every, val_images=a.val_images,
        final_eval_images=a.final_eval_images, aux_weight=a.aux_weight,
        init_encoder=None if a.init_encoder.lower() == "none" else a.init_encoder,
        distill_weight=a.distill_weight,
        aux_blocks=None if a.aux_blocks is None else [int(v) for v in a.aux_blocks.split(",") if v],
        value_weight=a.value_weight,
        label_smoothing=a.label_smoothing,
    )
    single = a.resume or a.steps is not None or a.batch_size is not None or a.lr is not None
    if single:  # one stage, as asked
        path = train(a.name, a.out, seed=a.seed, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                     resume=a.resume, **common)
    else:  # the model's full recipe (all stages)
        path = train_schedule(a.name, a.out, seed=a.seed, **common)
    with open(path, encoding="utf-8") as f:
        print(json.dumps(json.load(f)["metrics"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
