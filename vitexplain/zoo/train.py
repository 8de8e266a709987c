"""Train a zoo model on freshly generated shapes images.

Usage::

    python -m vitexplain.zoo.train shapes-cnn --out vitexplain/zoo/weights --threads 1
    python -m vitexplain.zoo.train shapes-vit --out vitexplain/zoo/weights --threads 1  # needs shapes-cnn
    python -m vitexplain.zoo.train shapes-captioner --out vitexplain/zoo/weights --threads 1  # needs shapes-vit
    python -m vitexplain.zoo.train shapes-sat --out vitexplain/zoo/weights --threads 1
    python -m vitexplain.zoo.train shapes-hier --out vitexplain/zoo/weights --threads 1
    python -m vitexplain.zoo.train_vlm --out vitexplain/zoo/weights --threads 1  # shapes-vlm, its own script
    python -m vitexplain.zoo.train NAME --out DIR --steps N [--resume CKPT.json]  # one stage, overrides

The first five commands reproduce the bundled weights (in this order: the ViT mimics the CNN's
features, the captioner starts from the ViT; ``shapes-sat`` and ``shapes-hier`` start from scratch;
``shapes-vlm`` has its own script); a run without ``--steps/--batch-size/--lr/--resume``
follows the model's full recipe (all stages). With any of them, one stage runs: the recipe's first
stage with those changes (loss-weight flags such as ``--value-weight`` change every stage). Each
checkpoint records, under ``training.command``, the command that trains its stage alone.

Every step draws a new batch from the synthetic generator, so no image is seen twice and there
is nothing to overfit to. Seeds (see also :mod:`vitexplain.zoo.evaluate`):

* training images: stream ``seed = --seed`` (must be ``< 9_000``), images
  ``step * batch_size .. (step + 1) * batch_size - 1``;
* validation printed during training: seed ``9_000`` (``VAL_SEED``);
* evaluation (tests, ``benchmarks/zoo_accuracy.py``, the metrics written into the config):
  seeds ``>= 10_000`` (``EVAL_SEED``), never used for training.

Recipes (:data:`RECIPES`: one :class:`Recipe` per model, a sequence of :class:`Stage` objects):
AdamW with warmup and cosine decay, gradient clipping at 1.0. The training-only heads live in :mod:`vitexplain.zoo.signals`;
the hooks they put on the model are removed in a ``finally`` block, also when training fails.

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
  *value-path token labels* (``ValueLabels``: what each patch token's value adds to the logits
  through the last attention must predict that patch's own classes; weight 2, then 4; 1,500 steps
  each). Without the last two, the ViT is as accurate but reads a shape's class partly from the
  other objects' tokens, so class-discriminative maps (CDAM, token Grad-CAM) point at the wrong
  object in 15-25% of two-object images; with them >= 90% point at the right one.
* ``shapes-cnn``: binary cross-entropy.
* ``shapes-captioner``: next-token cross-entropy (teacher forcing) plus the same token labeling
  on the encoder; the encoder starts from the trained ``shapes-vit`` trunk (``--init-encoder``,
  default: the bundled checkpoint), the decoder from scratch.
* ``shapes-hier`` (a timm Hiera with global attention in every block,
  :data:`~vitexplain.zoo.models.HIERA_GLOBAL_CONFIG`; ``--arch hiera-global``, the default), from
  scratch: binary cross-entropy plus token labeling (weight 0.5) of the last stage's 4 x 4 tokens
  and of the outputs of stages 0 and 1 (16 x 16 and 8 x 8; ``StageTokenLabels``, ``aux_blocks`` =
  stage indices). Five stages on new images: 1,500 steps x 64 images at lr 1e-3, 2,500 (seed + 1)
  and 2,500 (seed + 2) at 1e-3, 1,500 (seed + 3) and 2,500 (seed + 4) at 5e-4; 31 CPU minutes in
  all. ``generic`` pointing (``python benchmarks/hier_pointing.py --model CKPT.json --n 400 --seed
  S``: two-object images, each class targeted in turn, 800 targets, SE 0.006-0.008) on seeds
  20,000 / 21,000 / 22,000: 0.967 / 0.957 / 0.950 (vitexplain's maps point exactly as the
  benchmark's dense float64 oracle's; rollout 0.995-1.000 against either object); held-out label
  accuracy 0.985 (exact set 0.935). After each stage (seed 20,000, validation label accuracy in
  brackets; n 400 targets for the first two): 0.745 (0.80), 0.915 (0.92), 0.947 (0.966; 0.949 /
  0.946 on 21,000 / 22,000), 0.966 (0.977; 0.959 / 0.962), 0.967 (0.984): the fifth stage was
  kept for its accuracy (held-out 0.976 -> 0.985, exact set 0.895 -> 0.935), pointing being the same
  within its standard error. In place of the fourth stage, value-path token labels
  (``--value-weight 2``, ``HieraValueLabels``, as below) lowered pointing to 0.919 / 0.934 / 0.934
  (label accuracy 0.975).

  Tried before, each trainable with ``--arch`` (:data:`HIER_RECIPES`), both below 0.90:

  - ``--arch pvt`` (timm PVTv2, :data:`PVT_RECIPE`; bundled before the Hiera): the first two
    stages above; 0.897 / 0.880 / 0.890, label accuracy 0.996. Its misses are small objects (mean
    area 170 px against 216 for hits) whose peaks are displaced (6.8 px up and 9.1 px left of the
    object's centre on average; 2.7 and 3.9 px over all targets), not on the other object: PVTv2
    mixes tokens across positions outside attention (a 3 x 3 depthwise conv in every MLP,
    overlapping stride-2 patch embeddings, a 7 x 7 stem), which no rule that carries attention
    sees; reading its strided convs' footprints as 2 x 2 means (the benchmark's oracle) instead of
    3 x 3 moves the peaks the other way (0.836). Further training lowered pointing: a third stage
    (1,500 steps at 5e-4) 0.865 (0.855 on seed 21,000; label accuracy 0.999); head token labels
    (the head applied to each last-stage token predicts its classes; removed since) 0.77;
    value-path token labels
    (:class:`~vitexplain.zoo.pvt_signals.PvtValueLabels`, the PVTv2 form of the Hiera's below, on
    the last stage's two blocks: ``python -m vitexplain.zoo.train shapes-hier --arch pvt --out DIR
    --seed 2 --steps 1500 --lr 5e-4 --value-weight 2 --resume shapes-hier.json`` from the bundled
    PVTv2, 3.9 CPU min) 0.770 (n 400 targets, seed 20,000; label accuracy 0.998; ``gradcam`` rose
    from 0.42 to 0.71).
  - ``--arch hiera`` (:data:`~vitexplain.zoo.models.HIERA_CONFIG`, :data:`HIERA_RECIPE`): the same
    Hiera with mask-unit attention inside 16 x 16 px windows in its first three blocks (those
    pooling into stages 1 and 2 attend from each new token to its 2 x 2 children only). Three
    stages: 0.851 / 0.844 / 0.871 (label accuracy 0.969); a fourth, plain (2,500 steps), 0.830 on
    seed 20,000; the last block also restricted to mask units, 0.819; a fourth with
    *value-path token labels* (``HieraValueLabels``, :mod:`vitexplain.zoo.hiera_signals`: what
    each key's value adds through the blocks at the head's width, read by the head's norm and
    classifier, times a positive scale, must predict the classes of the key's own region; binary
    cross-entropy, the positive term weighted by the batch's negative-to-positive ratio) 0.869 /
    0.880 / 0.877 (label accuracy 0.980). About half its misses peaked on the other object. Split
    by block (the oracle with all blocks' ``A * dy/dA`` but one zeroed), the global last block alone
    pointed 0.885, while the two mask-unit pooling blocks carried the larger values and, in the
    missed images, more of them on the other object: hence the global variant, which points
    higher after every stage. Variants of the value labels (the ViT's form with a learned bias;
    all four blocks; per head; equal weight per key group; a second stage at weight 4) all pointed
    0.838-0.871.
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
import copy
import dataclasses
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from ..data.synthetic import shapes
from ..errors import NotFoundError, UsageError
from .evaluate import EVAL_SEED, VAL_SEED, evaluate, is_captioner
from .hub import names, save_checkpoint
from .models import DEFAULT_CONFIGS, HIER_VARIANTS, build
from .signals import TrainingSignals, mimetic_init, sincos_init

__all__ = ["Stage", "Recipe", "RunOptions", "RECIPES", "HIERA_RECIPE", "PVT_RECIPE", "HIER_RECIPES", "model_config",
           "train", "train_schedule", "main"]


@dataclass(frozen=True)
class Stage:
    """One training stage: what is optimised, on how many images, and with which training-only signals.

    Attributes:
        steps: optimisation steps.
        batch_size: images per step (each step draws a new batch).
        lr: peak learning rate.
        seed_offset: the stage trains on stream ``seed + seed_offset`` (new images per stage).
        aux_weight: weight of token labeling (ViTs and the captioner's encoder; ``AuxHeads``).
        aux_blocks: inner blocks whose outputs also get token labeling (``DeepTokenLabels``).
        value_weight: weight of the value-path token labels (ViT: ``ValueLabels``; Hiera:
            ``HieraValueLabels``).
        value_blocks: Hiera: the blocks whose keys get value-path token labels (empty: the blocks
            that write at the head's width).
        value_per_head: Hiera: label each head's share of a key's value on its own.
        distill_weight: ViT: weight of feature mimicking of the recipe's teacher (``FeatureDistill``).
        label_smoothing: captioner: label smoothing of the next-token cross-entropy.
        attention_reg: Show, Attend and Tell: weight of the doubly stochastic attention penalty.
    """

    steps: int
    batch_size: int
    lr: float
    seed_offset: int = 0
    aux_weight: float = 0.0
    aux_blocks: tuple[int, ...] = ()
    value_weight: float = 0.0
    value_blocks: tuple[int, ...] = ()
    value_per_head: bool = False
    distill_weight: float = 0.0
    label_smoothing: float = 0.0
    attention_reg: float = 0.0


@dataclass(frozen=True)
class Recipe:
    """How a zoo model is trained: its stages, in order, and what they share.

    Stage 1 starts from a fresh initialisation (or, for the captioner, from ``init_encoder``);
    every later stage resumes from the previous stage's weights with a fresh optimiser.

    Attributes:
        stages: the stages, first to last.
        weight_decay: AdamW weight decay (not on biases, norms, embeddings, tokens).
        warmup: linear warmup steps, at most a tenth of a stage's steps.
        attn_init: ``"mimetic"``: mimetic attention initialisation of a fresh ViT.
        distill_from: the zoo model whose features a ViT mimics (``distill_weight``).
        distill_block: the ViT block whose patch tokens mimic the teacher.
        init_encoder: captioner: the zoo ViT whose trunk starts the encoder.
    """

    stages: tuple[Stage, ...]
    weight_decay: float
    warmup: int
    attn_init: Optional[str] = None
    distill_from: Optional[str] = None
    distill_block: int = 1
    init_encoder: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.stages:
            raise UsageError("a recipe needs at least one stage")

    def warmup_steps(self, steps: int) -> int:
        """Warmup steps of a stage of ``steps`` steps."""
        return min(self.warmup, max(1, steps // 10))


@dataclass(frozen=True)
class RunOptions:
    """Logging and evaluation around training (nothing here changes the trained weights).

    Attributes:
        log_every: print the running loss every this many steps.
        eval_every: print validation accuracy (seed 9_000) every this many steps (0: never).
        val_images: validation images per check, and at the end.
        final_eval_images: held-out images (seed 10_000) scored at the end and stored in the config
            (0: skip).
        log: print function.
    """

    log_every: int = 50
    eval_every: int = 500
    val_images: int = 512
    final_eval_images: int = 1000
    log: Callable[[str], Any] = field(default=print, compare=False)


_VIT_STAGE = Stage(steps=4000, batch_size=32, lr=1e-3, aux_weight=0.5, distill_weight=1.0)
_HIER_STAGE = Stage(steps=1500, batch_size=64, lr=1e-3, aux_weight=0.5, aux_blocks=(0, 1))

#: How the mask-unit Hiera tried as ``shapes-hier`` (``--arch hiera``, not bundled) was trained: the
#: same losses as the bundled one, three stages on new images, all at lr 1e-3, then a fourth with
#: value-path token labels (``HieraValueLabels`` on the keys of the two blocks at the head's width) at lr 5e-4.
HIERA_RECIPE = Recipe(
    stages=(
        _HIER_STAGE,
        dataclasses.replace(_HIER_STAGE, steps=2500, seed_offset=1),
        dataclasses.replace(_HIER_STAGE, steps=2500, seed_offset=2),
        dataclasses.replace(_HIER_STAGE, steps=1500, lr=5e-4, seed_offset=3, value_weight=2.0),
    ),
    weight_decay=0.05, warmup=100,
)
#: How the PVTv2 bundled as ``shapes-hier`` before the Hiera (``--arch pvt``) was trained: binary
#: cross-entropy + token labeling of the last stage's tokens and of stages 0 and 1, two stages.
PVT_RECIPE = Recipe(
    stages=(
        _HIER_STAGE,
        dataclasses.replace(_HIER_STAGE, steps=2500, seed_offset=1),
    ),
    weight_decay=0.05, warmup=100,
)

#: The recipe of every zoo model: exactly how the bundled weights were trained (``training`` in
#: each bundled JSON records every stage; ``tests/test_zoo.py`` checks the two agree).
RECIPES: dict[str, Recipe] = {
    "shapes-vit": Recipe(
        stages=(
            _VIT_STAGE,
            dataclasses.replace(_VIT_STAGE, steps=3000, batch_size=64, lr=5e-4, seed_offset=1),
            dataclasses.replace(_VIT_STAGE, steps=750, batch_size=64, lr=3e-4, seed_offset=2, aux_blocks=(2,)),
            dataclasses.replace(_VIT_STAGE, steps=1500, batch_size=64, lr=3e-4, seed_offset=3, aux_blocks=(2,),
                                value_weight=2.0),
            dataclasses.replace(_VIT_STAGE, steps=1500, batch_size=64, lr=3e-4, seed_offset=4, aux_blocks=(2,),
                                value_weight=4.0),
        ),
        weight_decay=0.05, warmup=200, attn_init="mimetic", distill_from="shapes-cnn", distill_block=1,
    ),
    "shapes-cnn": Recipe(stages=(Stage(steps=1500, batch_size=64, lr=2e-3),), weight_decay=0.01, warmup=75),
    "shapes-captioner": Recipe(
        stages=(Stage(steps=2000, batch_size=64, lr=5e-4, aux_weight=0.5),),
        weight_decay=0.05, warmup=100, init_encoder="shapes-vit",
    ),
    # Hiera with global attention: binary cross-entropy + token labeling of the last stage's tokens and
    # of stages 0 and 1; five stages on new images, three at lr 1e-3, two at 5e-4
    "shapes-hier": Recipe(
        stages=(
            _HIER_STAGE,
            dataclasses.replace(_HIER_STAGE, steps=2500, seed_offset=1),
            dataclasses.replace(_HIER_STAGE, steps=2500, seed_offset=2),
            dataclasses.replace(_HIER_STAGE, steps=1500, lr=5e-4, seed_offset=3),
            dataclasses.replace(_HIER_STAGE, steps=2500, lr=5e-4, seed_offset=4),
        ),
        weight_decay=0.05, warmup=100,
    ),
    # Show, Attend and Tell: the caption's negative log-likelihood + doubly stochastic attention
    # regularisation + token labeling on the CNN grid (see TrainingSignals.loss).
    "shapes-sat": Recipe(
        stages=(Stage(steps=1500, batch_size=64, lr=2e-3, aux_weight=0.5, attention_reg=0.02),),
        weight_decay=0.01, warmup=100,
    ),
}
#: The recipe of each variant of ``shapes-hier`` (``--arch``, :data:`~vitexplain.zoo.models.HIER_VARIANTS`).
HIER_RECIPES: dict[str, Recipe] = {"hiera-global": RECIPES["shapes-hier"], "hiera": HIERA_RECIPE, "pvt": PVT_RECIPE}
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


def model_config(name: str, arch: Optional[str] = None) -> dict[str, Any]:
    """The zoo config a model is trained with: ``DEFAULT_CONFIGS[name]``, or for ``shapes-hier``
    with ``arch="hiera-global"`` (the bundled one), ``"hiera"`` or ``"pvt"`` that variant
    (:data:`~vitexplain.zoo.models.HIER_VARIANTS`)."""
    if name == "shapes-hier" and arch in HIER_VARIANTS:
        return {"name": name, **copy.deepcopy(HIER_VARIANTS[arch])}
    if arch is None or arch == DEFAULT_CONFIGS[name]["arch"]:
        return {"name": name, **DEFAULT_CONFIGS[name]}
    raise UsageError(f"{name} is a {DEFAULT_CONFIGS[name]['arch']!r} model; only shapes-hier can be trained as "
                     f"arch={' or '.join(repr(v) for v in HIER_VARIANTS)}, got arch={arch!r}")


def _resume(model: nn.Module, path: str, config: dict[str, Any], log: Callable[[str], Any]) -> dict[str, Any]:
    """Start from the weights of an earlier checkpoint of the same model (a further training stage).

    Returns:
        The earlier checkpoint's ``training`` record (kept in the new config under ``previous``).
    """
    from safetensors.torch import load_file

    p = Path(path)
    with open(p.with_suffix(".json"), encoding="utf-8") as f:
        cfg = json.load(f)
    name = config["name"]
    if cfg.get("name") != name or cfg.get("model_args") != config["model_args"]:
        raise UsageError(f"{p} is not a {name} checkpoint with the architecture being trained")
    model.load_state_dict(load_file(str(p.with_suffix(".safetensors"))), strict=True)
    log(f"[{name}] resumed weights from {p} ({cfg['training'].get('images_seen')} images seen)")
    return cfg["training"]


def _init_encoder(model: nn.Module, source: str, log: Callable[[str], Any]) -> None:
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


def _recipe(name: str) -> Recipe:
    if name not in DEFAULT_CONFIGS or name not in RECIPES:
        raise NotFoundError(f"unknown zoo model {name!r}; available: {', '.join(names())}")
    return RECIPES[name]


def _arch_recipe(name: str, arch: Optional[str]) -> Recipe:
    """The recipe of ``name`` trained as ``arch`` (a ``shapes-hier`` variant, or None: the model's own)."""
    return HIER_RECIPES[arch] if name == "shapes-hier" and arch in HIER_VARIANTS else _recipe(name)


def _command(name: str, stage: Stage, seed: int, resume: Optional[str], recipe: Recipe,
             arch: Optional[str] = None) -> str:
    """The command line that trains this stage alone: the flags of what differs from stage 1."""
    parts = [f"python -m vitexplain.zoo.train {name} --out DIR --seed {seed} --steps {stage.steps}"]
    if arch is not None:
        parts.append(f"--arch {arch}")
    first = recipe.stages[0]
    for f in dataclasses.fields(Stage):
        value = getattr(stage, f.name)
        if f.name in ("steps", "seed_offset") or value == getattr(first, f.name):
            continue
        if isinstance(value, tuple):
            text = ",".join(str(v) for v in value) or "''"
        elif isinstance(value, bool):
            text = str(int(value))
        else:
            text = f"{value:g}"
        parts.append(f"--{f.name.replace('_', '-')} {text}")
    if resume:
        parts.append(f"--resume {Path(resume).name}")
    return " ".join(parts)


def _initialise(model: nn.Module, config: dict[str, Any], recipe: Recipe, seed: int, resume: Optional[str],
                init_from: Optional[str], log: Callable[[str], Any]) -> Optional[dict[str, Any]]:
    """Fresh initialisation, a previous stage's weights, or a trained encoder; returns the resumed record."""
    if resume:
        return _resume(model, resume, config, log)
    if is_captioner(model) and init_from:
        _init_encoder(model, init_from, log)
    elif config["arch"] in ("vit", "captioner"):
        vit = model.encoder if is_captioner(model) else model
        sincos_init(vit)
        if recipe.attn_init == "mimetic":
            mimetic_init(vit, torch.Generator().manual_seed(seed))
    return None


def train(
    name: str,
    out: str | Path,
    stage: Optional[Stage] = None,
    *,
    seed: int = 0,
    resume: Optional[str] = None,
    init_encoder: Optional[str] = "default",
    run: RunOptions = RunOptions(),
    arch: Optional[str] = None,
) -> Path:
    """Train one stage of a zoo model and write its checkpoint.

    Args:
        name: one of :func:`vitexplain.zoo.names`.
        out: output folder; ``<name>.safetensors`` and ``<name>.json`` are written there.
        stage: what to train (default: the first stage of ``RECIPES[name]``; see :class:`Stage`).
        seed: training seed (``0 <= seed < 9_000``): initialisation and training-image stream.
        resume: start from this checkpoint (``.json``) of the same model instead of a fresh
            initialisation: a further training stage (use another ``seed`` so it sees new images).
        init_encoder: captioner only: initialise the encoder from this trained ViT (a zoo name
            or a checkpoint ``.json``); ``"default"``: the recipe's (the bundled ``shapes-vit``);
            None or ``"none"``: random init.
        run: logging and evaluation (:class:`RunOptions`).
        arch: ``shapes-hier`` only: ``"hiera-global"`` (the bundled variant), ``"hiera"`` or ``"pvt"``
            (:func:`model_config`; that variant's recipe, :data:`HIER_RECIPES`).

    Returns:
        Path of the written JSON config.
    """
    recipe = _arch_recipe(name, arch)
    stage = recipe.stages[0] if stage is None else stage
    if not 0 <= seed < MAX_TRAIN_SEED:
        raise UsageError(f"training seeds are 0..{MAX_TRAIN_SEED - 1} (higher seeds are held out)")
    if stage.steps < 1 or stage.batch_size < 1 or not stage.lr > 0:
        raise UsageError(f"a stage needs steps >= 1, batch_size >= 1 and lr > 0, got {stage}")
    log = run.log
    warmup = recipe.warmup_steps(stage.steps)

    torch.manual_seed(seed)
    config = model_config(name, arch)
    model = build(config)
    init_from = recipe.init_encoder if init_encoder == "default" else init_encoder
    init_from = None if init_from in (None, "none") else init_from
    previous = _initialise(model, config, recipe, seed, resume, init_from, log)
    model.train()
    groups = _param_groups(model, recipe.weight_decay)
    signals = TrainingSignals(
        model, config["arch"], aux_weight=stage.aux_weight, aux_blocks=stage.aux_blocks,
        value_weight=stage.value_weight, value_blocks=stage.value_blocks,
        value_per_head=stage.value_per_head, distill_weight=stage.distill_weight, distill_block=recipe.distill_block,
        teacher=lambda: _load_zoo(str(recipe.distill_from)), label_smoothing=stage.label_smoothing,
        attention_reg=stage.attention_reg,
    )
    try:
        groups[0]["params"] += signals.head_parameters()
        opt = torch.optim.AdamW(groups, lr=stage.lr, betas=(0.9, 0.999))
        n_params = sum(p.numel() for p in model.parameters())
        log(f"[{name}] {n_params / 1e6:.3f}M params, {stage.steps} steps x {stage.batch_size} images, "
            f"lr {stage.lr:g}, seed {seed}, {torch.get_num_threads()} threads")
        cpu0, wall0 = time.process_time(), time.perf_counter()
        data_time = _optimise(name, model, signals, opt, stage, seed, warmup, run)
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:  # the training-only hooks come off the model, also when training fails
        signals.remove()
    model.eval()
    config["training"] = {
        "command": _command(name, stage, seed, resume, recipe, arch),
        "seed": seed,
        "steps": stage.steps,
        "batch_size": stage.batch_size,
        "images_seen": stage.steps * stage.batch_size,
        "lr": stage.lr,
        "weight_decay": recipe.weight_decay,
        "attn_init": recipe.attn_init if config["arch"] == "vit" else None,
        "aux_weight": stage.aux_weight,
        "aux_blocks": list(stage.aux_blocks) if signals.deep is not None else None,
        "value_weight": stage.value_weight if signals.value is not None else None,
        "value_blocks": list(signals.value.blocks) if hasattr(signals.value, "blocks") else None,
        "value_per_head": signals.value.per_head if hasattr(signals.value, "per_head") else None,
        "label_smoothing": stage.label_smoothing if is_captioner(model) else None,
        "distill": f"{recipe.distill_from} layer4 -> block {recipe.distill_block} tokens, "
                   f"weight {stage.distill_weight}" if signals.distill is not None else None,
        "init_encoder": init_from if is_captioner(model) else None,
        "pos_embed_init": "2d sincos" if config["arch"] == "vit" or (config["arch"] == "captioner" and not init_from)
        else None,
        "attention_reg": f"doubly stochastic attention, weight {stage.attention_reg}" if stage.attention_reg else None,
        "aux_loss": "token labeling: soft CE of per-patch shape/color coverage (training-only heads)"
        if stage.aux_weight > 0 else None,
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
        config["training"]["images_seen_total"] = stage.steps * stage.batch_size + int(
            previous.get("images_seen_total", previous.get("images_seen", 0)))
        config["training"]["cpu_time_s_total"] = round(cpu_s + float(
            previous.get("cpu_time_s_total", previous.get("cpu_time_s", 0.0))), 1)
    config["metrics"] = _final_metrics(name, model, run)
    path = save_checkpoint(model, config, out)
    log(f"[{name}] done: CPU time {cpu_s:.0f}s ({cpu_s / 60:.1f} min, {torch.get_num_threads()} threads), "
        f"wall {wall_s:.0f}s; wrote {path} and {path.with_suffix('.safetensors')}")
    return path


def _optimise(name: str, model: nn.Module, signals: TrainingSignals, opt: torch.optim.Optimizer, stage: Stage,
              seed: int, warmup: int, run: RunOptions) -> float:
    """The training loop of one stage; returns the seconds spent generating data."""
    data_time, running = 0.0, 0.0
    wall0 = time.perf_counter()
    for step in range(stage.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, stage.steps, stage.lr, warmup)
        t0 = time.perf_counter()
        batch = shapes(stage.batch_size, seed=seed, start=step * stage.batch_size)
        data_time += time.perf_counter() - t0
        loss = signals.loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        running = loss.item() if step == 0 else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % run.log_every == 0 or step + 1 == stage.steps:
            wall = time.perf_counter() - wall0
            run.log(f"[{name}] step {step + 1}/{stage.steps} loss {running:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                    f"{(step + 1) * stage.batch_size / wall:.0f} img/s wall {wall:.0f}s")
        if run.eval_every and (step + 1) % run.eval_every == 0 and step + 1 < stage.steps:
            run.log(f"[{name}] val@{step + 1} (seed {VAL_SEED}): {_fmt(evaluate(model, run.val_images, VAL_SEED))}")
    return data_time


def _final_metrics(name: str, model: nn.Module, run: RunOptions) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    if run.val_images:
        metrics["val"] = {"seed": VAL_SEED, **evaluate(model, run.val_images, VAL_SEED)}
        run.log(f"[{name}] val (seed {VAL_SEED}): {_fmt(metrics['val'])}")
    if run.final_eval_images:
        metrics["eval"] = {"seed": EVAL_SEED, **evaluate(model, run.final_eval_images, EVAL_SEED)}
        run.log(f"[{name}] held-out (seed {EVAL_SEED}): {_fmt(metrics['eval'])}")
    return metrics


def train_schedule(
    name: str,
    out: str | Path,
    seed: int = 0,
    *,
    recipe: Optional[Recipe] = None,
    init_encoder: Optional[str] = "default",
    run: RunOptions = RunOptions(),
    arch: Optional[str] = None,
) -> Path:
    """Run a model's whole recipe: every stage in order, each resumed from the one before.

    Intermediate checkpoints go to ``out/stages/<k>/`` (without the held-out evaluation); the
    last stage writes ``out/<name>.json`` with the earlier stages' records nested under
    ``training.previous``.

    Args:
        name: zoo model name.
        out: output folder.
        seed: training seed; stage k trains on stream ``seed + stage.seed_offset``.
        recipe: the stages to run (default: ``RECIPES[name]``; :data:`HIER_RECIPES` ``[arch]`` with ``arch``).
        init_encoder: see :func:`train` (first stage only).
        run: logging and evaluation.
        arch: see :func:`train`.

    Returns:
        Path of the final JSON config.
    """
    if recipe is None:
        recipe = _arch_recipe(name, arch)
    out = Path(out)
    resume: Optional[str] = None
    for k, stage in enumerate(recipe.stages, start=1):
        last = k == len(recipe.stages)
        path = train(
            name, out if last else out / "stages" / str(k), stage, seed=seed + stage.seed_offset,
            resume=resume, init_encoder=init_encoder,
            run=run if last else dataclasses.replace(run, final_eval_images=0), arch=arch,
        )
        resume = str(path)
    return path


def _load_zoo(name: str) -> nn.Module:
    from .hub import load

    return load(name)


def _timm_version() -> str:
    import timm

    return str(timm.__version__)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m vitexplain.zoo.train", description=__doc__.split("\n")[0])
    p.add_argument("name", choices=[n for n in names() if n in RECIPES],
                   help="zoo model (shapes-vlm: python -m vitexplain.zoo.train_vlm)")
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
                   help="ViT/Hiera: weight of the value-path token labels (default: the recipe's)")
    p.add_argument("--value-blocks", default=None,
                   help="Hiera: comma-separated blocks whose keys get value-path token labels "
                        "(default: the recipe's; '': the blocks at the head's width)")
    p.add_argument("--value-per-head", type=int, choices=[0, 1], default=None,
                   help="Hiera: 1 = label each head's share of a key's value on its own (default: the recipe's)")
    p.add_argument("--label-smoothing", type=float, default=None,
                   help="captioner: label smoothing of the next-token loss (default: the recipe's)")
    p.add_argument("--attention-reg", type=float, default=None,
                   help="shapes-sat: weight of the doubly stochastic attention penalty (default: the recipe's)")
    p.add_argument("--resume", default=None,
                   help="a further training stage: start from this checkpoint (.json) of the same model")
    p.add_argument("--arch", default=None, choices=list(HIER_VARIANTS),
                   help="shapes-hier only: the variant to train (hiera-global: the bundled one; hiera, pvt: tried "
                        "before, see the module docstring)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's default, all cores); on a machine shared with "
                        "other jobs, 1 thread per training run is faster than oversubscribed threads")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    run = RunOptions(log_every=a.log_every, eval_every=a.eval_every, val_images=a.val_images,
                     final_eval_images=a.final_eval_images)
    weights = {k: v for k, v in dict(
        aux_weight=a.aux_weight, distill_weight=a.distill_weight, value_weight=a.value_weight,
        label_smoothing=a.label_smoothing, attention_reg=a.attention_reg,
        aux_blocks=None if a.aux_blocks is None else tuple(int(v) for v in a.aux_blocks.split(",") if v),
        value_per_head=None if a.value_per_head is None else bool(a.value_per_head),
        value_blocks=None if a.value_blocks is None else tuple(int(v) for v in a.value_blocks.split(",") if v),
    ).items() if v is not None}
    model_config(a.name, a.arch)  # a wrong --arch fails before any training
    recipe = _arch_recipe(a.name, a.arch)
    init_encoder = None if a.init_encoder.lower() == "none" else a.init_encoder
    single = {k: v for k, v in dict(steps=a.steps, batch_size=a.batch_size, lr=a.lr).items() if v is not None}
    if single or a.resume:  # one stage, as asked: the recipe's first stage with these changes
        stage = dataclasses.replace(recipe.stages[0], **single, **weights)
        path = train(a.name, a.out, stage, seed=a.seed, resume=a.resume, init_encoder=init_encoder, run=run,
                     arch=a.arch)
    else:  # the model's full recipe (all stages)
        stages = tuple(dataclasses.replace(s, **weights) for s in recipe.stages)
        path = train_schedule(a.name, a.out, seed=a.seed, recipe=dataclasses.replace(recipe, stages=stages),
                              init_encoder=init_encoder, run=run, arch=a.arch)
    with open(path, encoding="utf-8") as f:
        print(json.dumps(json.load(f)["metrics"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
