"""Training-only signals of the zoo's ViT classifier (``shapes-vit``): value-path token labels and feature mimicking.

The ViT counterparts of :mod:`vitexplain.zoo.pvt_signals` and :mod:`vitexplain.zoo.hiera_signals`. Nothing here is
saved with the model: the learned scale, bias and projection live beside it, and the forward hooks they put on it
are removed by their ``remove`` (called by :meth:`~vitexplain.zoo.signals.TrainingSignals.remove`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .outputs import Outputs

__all__ = ["ValueLabels", "FeatureDistill"]


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
