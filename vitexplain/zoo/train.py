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

What each model is trained with, stage by stage, and why (what was tried and how it pointed):
:mod:`vitexplain.zoo.recipes` (:data:`~vitexplain.zoo.recipes.RECIPES`). The training-only heads are built by
:mod:`vitexplain.zoo.signals`; the hooks they put on the model are removed in a ``finally`` block, also when
training fails.

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
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from ..data.synthetic import shapes
from ..errors import NotFoundError, UsageError
from .evaluate import VAL_SEED, evaluate, final_metrics, format_metrics, is_captioner
from .hub import names, save_checkpoint
from .initialise import initialise
from .models import DEFAULT_CONFIGS, HIER_VARIANTS, build
from .recipes import (HIER_RECIPES, HIERA_RECIPE, MAX_TRAIN_SEED, PVT_RECIPE, RECIPES, Recipe, RunOptions, Stage, lr_at,
                      param_groups)
from .signals import TrainingSignals

__all__ = ["Stage", "Recipe", "RunOptions", "RECIPES", "HIERA_RECIPE", "PVT_RECIPE", "HIER_RECIPES", "model_config",
           "train", "train_schedule", "main"]


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
    previous = initialise(model, config, recipe, seed, resume, init_from, log)
    model.train()
    groups = param_groups(model, recipe.weight_decay)
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
    config["metrics"] = final_metrics(name, model, run)
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
            group["lr"] = lr_at(step, stage.steps, stage.lr, warmup)
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
            run.log(f"[{name}] val@{step + 1} (seed {VAL_SEED}): {format_metrics(evaluate(model, run.val_images, VAL_SEED))}")
    return data_time


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
