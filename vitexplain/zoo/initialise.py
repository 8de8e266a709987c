"""Initialisations of a zoo ViT before training: a 2-D sin-cos position embedding and mimetic attention weights.

Both are locality priors that let a small ViT learn from few images (see :mod:`vitexplain.zoo.recipes`); the
training loop (:mod:`vitexplain.zoo.train`) applies them to a freshly built model.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["sincos_init", "mimetic_init"]


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
