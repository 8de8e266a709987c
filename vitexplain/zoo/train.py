"""Train a zoo model on freshly generated shapes images.

Usage::

    python -m vitexplain.zoo.train shapes-vit --out vitexplain/zoo/weights [--seed 0] [--steps N]
    python -m vitexplain.zoo.train shapes-cnn --out vitexplain/zoo/weights
    python -m vitexplain.zoo.train shapes-captioner --out vitexplain/zoo/weights \
        [--init-encoder vitexplain/zoo/weights/shapes-vit.json]

Every step draws a new batch from the synthetic generator, so no image is seen twice and there
is nothing to overfit to. Seeds (see also :mod:`vitexplain.zoo.evaluate`):

* training images: stream ``seed = --seed`` (must be ``< 9_000``), images
  ``step * batch_size .. (step + 1) * batch_size - 1``;
* validation printed during training: seed ``9_000`` (``VAL_SEED``);
* evaluation (tests, ``benchmarks/zoo_accuracy.py``, the metrics written into the config):
  seeds ``>= 10_000`` (``EVAL_SEED``), never used for training.

Recipes (:data:`RECIPES`): AdamW with warmup and cosine decay, gradient clipping at 1.0.

* ``shapes-vit``: position embedding initialised with 2-D sin-cos values (still learned);
  binary cross-entropy on the class token's logits, plus *token labeling*
  (Jiang et al. 2021): training-only linear heads on the final patch tokens predict the soft
  shape-class and color coverage of each patch (background included). The heads are dropped
  after training, the saved model is a plain timm ``VisionTransformer``.
* ``shapes-cnn``: binary cross-entropy.
* ``shapes-captioner``: next-token cross-entropy (teacher forcing) plus the same token labeling
  on the encoder; the encoder starts from the trained ``shapes-vit`` trunk (``--init-encoder``,
  default: the bundled checkpoint), the decoder from scratch.

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

from ..data.shapes import COLORS, SHAPES, shapes
from .evaluate import EVAL_SEED, VAL_SEED, evaluate, is_captioner
from .hub import names, save_checkpoint
from .models import DEFAULT_CONFIGS, build

__all__ = ["RECIPES", "train", "main"]

#: Optimisation recipe per model: steps, batch size, peak learning rate, weight decay, warmup.
#: ``aux_weight`` is the weight of the token-labeling loss (ViTs only; see ``_AuxHeads``).
RECIPES: dict[str, dict[str, Any]] = {
    "shapes-vit": {"steps": 4000, "batch_size": 32, "lr": 1e-3, "weight_decay": 0.05, "warmup": 200,
                   "aux_weight": 0.5, "attn_init": "mimetic"},
    "shapes-cnn": {"steps": 1500, "batch_size": 64, "lr": 2e-3, "weight_decay": 0.01, "warmup": 75,
                   "aux_weight": 0.0},
    "shapes-captioner": {"steps": 1500, "batch_size": 64, "lr": 5e-4, "weight_decay": 0.05, "warmup": 75,
                         "aux_weight": 0.5, "init_encoder": "shapes-vit"},
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

    def forward(self, tokens: torch.Tensor, batch: Any, patch: int) -> torch.Tensor:
        shape_t, color_t = patch_targets(batch, patch)
        return _soft_ce(self.shape(tokens), shape_t) + _soft_ce(self.color(tokens), color_t)


def _loss(model: nn.Module, batch: Any, aux: Optional[_AuxHeads], aux_weight: float) -> torch.Tensor:
    x = batch.tensor
    if is_captioner(model):
        seq = model.tokenize(batch.captions)
        memory = model.encode(x)
        logits = model.decode_step(seq[:, :-1], memory)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1), ignore_index=model.vocab.pad_id
        )
        vit, tokens = model.encoder, memory
    elif hasattr(model, "forward_features") and hasattr(model, "num_prefix_tokens"):  # timm ViT
        tokens = model.forward_features(x)
        loss = F.binary_cross_entropy_with_logits(model.forward_head(tokens), batch.labels)
        vit = model
    else:
        return F.binary_cross_entropy_with_logits(model(x), batch.labels)
    if aux is not None and aux_weight > 0:
        patch = int(vit.patch_embed.patch_size[0])
        loss = loss + aux_weight * aux(tokens[:, vit.num_prefix_tokens:], batch, patch)
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
        raise ValueError(f"{source} does not match the captioner encoder: missing {missing}, "
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
        log: print function.

    Returns:
        Path of the written JSON config.
    """
    if name not in DEFAULT_CONFIGS:
        raise KeyError(f"unknown zoo model {name!r}; available: {', '.join(names())}")
    if not 0 <= seed < MAX_TRAIN_SEED:
        raise ValueError(f"training seeds are 0..{MAX_TRAIN_SEED - 1} (higher seeds are held out)")
    recipe = dict(RECIPES[name])
    steps = int(steps if steps is not None else recipe["steps"])
    batch_size = int(batch_size or recipe["batch_size"])
    peak_lr = float(lr or recipe["lr"])
    warmup = min(int(recipe["warmup"]), max(1, steps // 10))

    torch.manual_seed(seed)
    config: dict[str, Any] = {"name": name, **DEFAULT_CONFIGS[name]}
    model = build(config)
    init_from = recipe.get("init_encoder") if init_encoder == "default" else init_encoder
    if is_captioner(model) and init_from:
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
        loss = _loss(model, batch, aux, aux_weight)
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
        "aux_weight": aux_weight,
        "init_encoder": init_from if is_captioner(model) else None,
        "pos_embed_init": "2d sincos" if config["arch"] == "vit" or (is_captioner(model) and not init_from)
        else None,
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
    config["metrics"] = metrics
    path = save_checkpoint(model, config, out)
    log(f"[{name}] done: CPU time {cpu_s:.0f}s ({cpu_s / 60:.1f} min, {torch.get_num_threads()} threads), "
        f"wall {wall_s:.0f}s; wrote {path} and {path.with_suffix('.safetensors')}")
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
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's default, all cores); on a machine shared with "
                        "other jobs, 1 thread per training run is faster than oversubscribed threads")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    path = train(
        a.name, a.out, seed=a.seed, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
        log_every=a.log_every, eval_every=a.eval_every, val_images=a.val_images,
        final_eval_images=a.final_eval_images, aux_weight=a.aux_weight,
        init_encoder=None if a.init_encoder.lower() == "none" else a.init_encoder,
    )
    with open(path, encoding="utf-8") as f:
        print(json.dumps(json.load(f)["metrics"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
