"""Where a zoo model's training stage starts: fresh weights, an earlier stage's, or a trained ViT's trunk.

:func:`initialise` is what :func:`vitexplain.zoo.train.train` calls on a freshly built model: it loads an earlier
checkpoint of the same model (a further stage), copies a trained zoo ViT's trunk into a captioner's encoder, or
initialises a ViT's position embedding with 2-D sin-cos values (:func:`sincos_init`) and, when the recipe says so,
its attention mimetically (:func:`mimetic_init`): locality priors that let a small ViT learn from few images (see
:mod:`vitexplain.zoo.recipes`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from ..errors import UsageError
from .evaluate import is_captioner
from .hub import names
from .recipes import Recipe

__all__ = ["initialise", "sincos_init", "mimetic_init"]


def initialise(model: nn.Module, config: dict[str, Any], recipe: Recipe, seed: int, resume: Optional[str],
                init_from: Optional[str], log: Callable[[str], Any]) -> Optional[dict[str, Any]]:
    """Fresh initialisation, a previous stage's weights, or a trained encoder; returns the resumed record.

    Args:
        model: the freshly built model (:func:`~vitexplain.zoo.models.build` of ``config``).
        config: its zoo config (``name``, ``arch``, ``model_args``).
        recipe: its recipe (``attn_init``: ``"mimetic"`` or not).
        seed: the training seed (mimetic initialisation's generator).
        resume: an earlier checkpoint (``.json``) of the same model to start from, or None.
        init_from: captioner only: the trained ViT (zoo name or checkpoint ``.json``) its encoder starts from, or None.
        log: print function.

    Returns:
        The resumed checkpoint's ``training`` record, or None.
    """
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
