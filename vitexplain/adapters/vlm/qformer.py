"""BLIP-2 and InstructBLIP: a Q-Former between the vision tower and the language model.

The language model's image tokens are the Q-Former's learned queries (``num_query_tokens`` of
them, in the sequence where the processor put its ``<image>`` tokens); each query reads every patch
through the Q-Former's cross-attention, so a query has no footprint of its own. The methods score
the query tokens in the language model's sequence (``token_scores``); those scores reach the
patches through the Q-Former's cross-attention of the same forward:
``patch scores = query scores @ mean_{layers, heads} A_cross[queries, patches]`` (the class token's
column is dropped: it carries no pixels). The patch grid covers the whole resized image (the BLIP
image processor resizes without cropping). InstructBLIP's Q-Former also reads the prompt
(``qformer_input_ids``); its cross-attention is issued by the queries alone, as in BLIP-2.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ...errors import UnsupportedMethodError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import ImageView, Piece, VLMAdapter, processed_box

__all__ = ["QFormerAdapter"]

_NAMES = ("Blip2ForConditionalGeneration", "InstructBlipForConditionalGeneration")


class QFormerAdapter(VLMAdapter):
    """``Blip2ForConditionalGeneration`` and ``InstructBlipForConditionalGeneration``."""

    def format_prompt(self, prompt: str) -> str:
        return prompt  # the processor puts the query tokens in front

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        vision = self.model.config.vision_config
        grid = (vision.image_size // vision.patch_size, vision.image_size // vision.patch_size)
        queries = int(self.model.config.num_query_tokens)
        views = []
        for image in images:
            h, w = int(image.shape[0]), int(image.shape[1])
            box = processed_box(self.processor.image_processor, h, w)
            views.append(ImageView((h, w), (Piece("image", grid, box, 0),), sequence_tokens=queries))
        return views

    def to_pixel_tokens(self, scores: list[Tensor], recorder: Any) -> list[Tensor]:
        """(T, queries) scores -> (T, patches) through the mean Q-Former cross-attention of each image."""
        cross = [r for r in recorder.records if r.kind == "cross" and r.name.startswith("qformer.")]
        if not cross:
            raise UnsupportedMethodError(
                "no Q-Former cross-attention was recorded, so the query tokens cannot be mapped to the patches; "
                "load the model with attn_implementation='sdpa' (or 'eager')"
            )
        attention = torch.stack([r.probs().mean(dim=1) for r in cross]).mean(dim=0)[..., 1:]  # (B, Q, P): no class token
        return [score @ attention[b].to(score.dtype) for b, score in enumerate(scores)]


@register_adapter(priority=20, family=VLM)
def _detect_qformer(model: nn.Module) -> Optional[Adapter]:
    return QFormerAdapter(model) if type(model).__name__ in _NAMES else None
