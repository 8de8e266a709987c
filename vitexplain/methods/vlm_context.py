"""The input of the vision-language (VLM) methods: one teacher-forced forward of a batch.

A decoder-only VLM (LLaVA, PaliGemma, Qwen-VL, Gemma 3, ...) puts its image tokens inside the
language model's sequence. The explained forward runs the prompt (image tokens included) and the
answer words teacher-forced in one sequence; prompts are left-padded to one length ``L``, so the
answer word ``t`` of every image sits at position ``L + t`` and is predicted by row ``L - 1 + t``
of every language-model attention call. ``columns[b]`` are the positions of image ``b``'s
pixel-bearing image tokens (newline and separator tokens excluded), in the order the adapter's
token-to-pixel map reads them. A model whose image enters through cross-attention layers (mllama)
has no image tokens in its sequence: ``columns[b]`` then index the keys of those layers' calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from ..errors import UnsupportedMethodError
from ..recording import AttentionRecord, Recorder

__all__ = ["VLMContext"]


@dataclass
class VLMContext:
    """One explained batch of a vision-language model.

    Attributes:
        adapter: the VLM adapter (``vitexplain.adapters.vlm``).
        recorder: the capture of the teacher-forced forward (with gradients for gradient methods).
        ids: (B, T) long, the explained answer token ids (padded after each answer's end).
        lengths: (B,) long, how many of the T words each image has.
        start: L, the position of answer word 0 (so row ``start - 1 + t`` predicts word t).
        columns: per image, (n_b,) long positions of its pixel-bearing image tokens (with cross-attention
            layers: their indices among the cross-attention keys).
        logits: (B, N, V) logits of the teacher-forced forward, in the autograd graph for
            gradient methods (None otherwise).
        method: the method name (for messages).
        inputs: the teacher-forced forward's keyword arguments (prompt + answer ids, pixels, masks), for a
            method that runs the forward again under rules of its own (AttnLRP); None where not given.
    """

    adapter: Any
    recorder: Recorder
    ids: Tensor
    lengths: Tensor
    start: int
    columns: list[Tensor]
    logits: Optional[Tensor] = None
    method: str = ""
    inputs: Optional[dict[str, Any]] = None

    @property
    def batch_size(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_words(self) -> int:
        return int(self.ids.shape[1])

    @property
    def rows(self) -> slice:
        """The query rows that predict words 0..T-1 (the same for every image: prompts are left-padded)."""
        return slice(self.start - 1, self.start - 1 + self.num_words)

    @property
    def cross_layers(self) -> bool:
        """The image enters the language model through cross-attention layers (mllama): :meth:`layers`
        are those layers' calls and ``columns`` index their keys."""
        return bool(getattr(self.adapter, "cross_layers", False))  # (adapters of other families have none)

    def layers(self) -> list[AttentionRecord]:
        """The language model's attention calls over the image tokens in the explained forward, one per
        layer in order: its self-attention calls, or its cross-attention calls (:attr:`cross_layers`).

        Raises:
            UnsupportedMethodError: no language-model attention was recorded.
        """
        records = self.adapter.lm_records(self.recorder.records)
        if not records:
            raise UnsupportedMethodError(
                f"{self.method}: no attention call of {type(self.adapter.model).__name__}'s language model "
                "was recorded; load the model with attn_implementation='sdpa' (or 'eager')"
            )
        n = self.start + self.num_words - 1
        for record in records:
            if record.num_queries < n or (record.kind == "self" and record.num_keys < n):
                raise UnsupportedMethodError(
                    f"{self.method}: the language-model call {record.name!r} covers {record.num_queries} queries, "
                    f"but the explained sequence has {n}; the forward was not teacher-forced in one call"
                )
        return records

    def gather(self, rows: Tensor) -> list[Tensor]:
        """Per image, its image-token columns of (B, T, N) rows: a list of (T, n_b)."""
        return [rows[b][:, cols] for b, cols in enumerate(self.columns)]

    def word_scores(self, word: int) -> Tensor:
        """(B,) log-probability of answer word ``word`` per image (0 where the answer is shorter),
        in the autograd graph.

        Raises:
            UnsupportedMethodError: the forward kept no logits with gradients.
        """
        if self.logits is None or not self.logits.requires_grad:
            raise UnsupportedMethodError(f"{self.method} needs a teacher-forced forward with gradients")
        row = self.logits[:, self.start - 1 + word].float()
        log_probs = torch.log_softmax(row, dim=-1).gather(1, self.ids[:, word : word + 1])[:, 0]
        return torch.where(self.lengths > word, log_probs, torch.zeros_like(log_probs))
