"""Hierarchical adapter for Hugging Face PVT v1 (``PvtModel``, ``PvtForImageClassification``).

PVT v1 embeds each stage's grid with a non-overlapping strided conv (``encoder.patch_embeddings[s]``),
adds position embeddings and, on the last stage, a class token (first); its attention (eager softmax, in
``encoder.block[s][b].attention.self``) reads keys and values spatially reduced by a strided conv
(``sequence_reduction``, kernel = stride = the stage's ratio; none on the last stage). The classifier reads
the class token; a headless ``PvtModel`` is scored here by the mean of its last grid tokens (the class token
left out). The class token joins at the last embedding: its relevance carries nothing of the grid before.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from ..layout import pair
from ..methods.families import HIER
from ..methods.resample import TokenSet, Transition
from .base import Adapter, classifies, register_adapter
from .hier import Chain, HierAdapter, conv_footprint, conv_grid, global_call, module_family, token_set

__all__ = ["HFPvtAdapter"]


class HFPvtAdapter(HierAdapter):
    """Hugging Face PVT v1: spatial-reduction attention per stage, a class token on the last stage."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.base = "pvt." if hasattr(model, "pvt") else ""
        encoder = model.get_submodule(f"{self.base}encoder")
        self.embeddings, self.blocks = encoder.patch_embeddings, encoder.block
        self.classifier = getattr(model, "classifier", None)  # (num_labels=0: nn.Identity, reading the class token)
        self.has_head = classifies(self.classifier)
        self.prefixes = [int(getattr(e, "cls_token", None) is not None) for e in self.embeddings]
        self.readout = "class" if self.classifier is not None and self.prefixes[-1] else "mean"
        self.token_sites = [f"{self.base}encoder.block.{s}.{len(stage) - 1}.layer_norm_1" for s, stage in enumerate(self.blocks)]
        self.fixed_size = pair(model.config.image_size)
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        s = len(self.blocks) - 1
        return [f"{self.base}encoder.block.{s}.{b}.attention.self" for b in range(len(self.blocks[s]))]

    def legrad_site(self, call: str) -> tuple[str, str]:
        """A call's block is its ``PvtLayer`` (its output: the first item of a tuple)."""
        return call.rsplit(".attention.self", 1)[0], "output"

    def head_on(self, tokens: Tensor) -> Tensor:
        """On (B, N, C) last-stage tokens: the encoder's final LayerNorm, then the classifier on the class token
        (headless, or no class token: the mean of the grid tokens, as :meth:`forward` reads it)."""
        normed = self.model.get_submodule(f"{self.base}encoder").layer_norm(tokens)
        if self.classifier is not None:
            return self.classifier(normed[:, 0])
        return normed[:, self.prefixes[-1]:].mean(dim=1)

    def forward(self, x: Tensor) -> Any:
        out = self.model(pixel_values=x, return_dict=True)
        logits = getattr(out, "logits", None)
        return logits if logits is not None else out.last_hidden_state[:, self.prefixes[-1]:].mean(dim=1)

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        chain: Chain = []
        sets: list[TokenSet] = []
        tokens: Optional[TokenSet] = None
        for s, (embed, stage) in enumerate(zip(self.embeddings, self.blocks)):
            conv = embed.projection
            if tokens is None:
                tokens = token_set(conv_grid(input_size, conv.kernel_size, conv.stride, conv.padding), self.prefixes[s])
            else:
                down = conv_footprint(tokens, conv, self.prefixes[s])
                chain.append(Transition(down, s - 1, s, f"{self.base}encoder.patch_embeddings.{s}"))
                tokens = down.coarse
            sets.append(tokens)
            for b, block in enumerate(stage):
                attn = block.attention.self
                sr = getattr(attn, "sequence_reduction", None) if attn.sequences_reduction_ratio > 1 else None
                keys = conv_footprint(tokens, sr, prefix=0) if isinstance(sr, nn.Conv2d) else None  # (keys: no class token)
                chain.append(global_call(f"{self.base}encoder.block.{s}.{b}.attention.self", tokens, s, keys))
        return chain, sets


@register_adapter(priority=15, family=HIER)
def _detect_hf_pvt(model: nn.Module) -> Optional[Adapter]:
    if module_family(model, "transformers.models.pvt.") and type(model).__name__ in ("PvtModel", "PvtForImageClassification"):
        return HFPvtAdapter(model)
    return None
