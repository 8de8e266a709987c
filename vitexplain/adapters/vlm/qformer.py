"""BLIP-2, InstructBLIP and Kosmos-2: learned queries between the vision tower and the language model.

The language model's image tokens are the Q-Former's learned queries (``num_query_tokens`` of
them, in the sequence where the processor put its ``<image>`` tokens); each query reads every patch
through the Q-Former's cross-attention, so a query has no footprint of its own. The methods score
the query tokens in the language model's sequence (``token_scores``); those scores reach the
patches through the Q-Former's cross-attention of the same forward:
``patch scores = query scores @ mean_{layers, heads} A_cross[queries, patches]`` (the class token's
column is dropped: it carries no pixels). The patch grid covers the whole resized image (the BLIP
image processor resizes without cropping). InstructBLIP's Q-Former also reads the prompt
(``qformer_input_ids``); its cross-attention is issued by the queries alone, as in BLIP-2.

Kosmos-2 does the same with one cross-attention (``image_to_text_projection.x_attn``) of its latent
queries over [class token, patches, latent queries]: only the patch columns reach pixels. Its image
tokens are marked by ``image_embeds_position_mask``, and it counts its positions itself (from the
ids, skipping padding).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ...errors import InputError, UnsupportedMethodError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .views import ImageView, Piece, processed_box

__all__ = ["QFormerAdapter"]

_NAMES = ("Blip2ForConditionalGeneration", "InstructBlipForConditionalGeneration", "Kosmos2ForConditionalGeneration")


class QFormerAdapter(VLMAdapter):
    """``Blip2ForConditionalGeneration`` and ``InstructBlipForConditionalGeneration``."""

    def __init__(self, model: nn.Module, processor: Any = None) -> None:
        super().__init__(model, processor)
        if type(model).__name__ == "InstructBlipForConditionalGeneration":  # its Q-Former reads the prompt
            self.required_inputs = ("qformer_input_ids",)
            self.required_for = "for its Q-Former, which reads the prompt"

    def format_prompt(self, prompt: str) -> str:
        return self.bare_prompt(prompt)  # the processor puts the query tokens in front

    @property
    def kosmos(self) -> bool:
        return type(self.model).__name__ == "Kosmos2ForConditionalGeneration"

    @property
    def answer_values(self) -> dict[str, int]:  # type: ignore[override]
        return {"image_embeds_position_mask": 0} if self.kosmos else {}  # (Kosmos-2: the answer holds no image)

    @property
    def placeholder_ids(self) -> list[int]:
        if self.kosmos:  # its image positions hold ordinary ids; it reads a pad id as padding (no position)
            return [self.pad_id]
        return super().placeholder_ids

    def prepare(self, images: Sequence[Any], prompts: Sequence[str]) -> Any:
        """The processor's batch, with each prompt's padding moved in front of its query tokens: BLIP-2's and
        InstructBLIP's processors put the query tokens in front of the left-padded prompt, so in a batch an
        empty prompt (no BOS token) would end in padding. Padding is masked and positions count the unmasked
        tokens, so where it sits changes nothing else. InstructBLIP's Q-Former text is padded on the right
        whatever side its tokenizer says: the Q-Former gives it learned positions 0, 1, ... from the first
        column, padding included, so left padding would shift a shorter prompt's positions (its map would
        differ from the image alone)."""
        second = getattr(self.processor, "qformer_tokenizer", None)
        side = getattr(second, "padding_side", None)
        if side is not None:
            second.padding_side = "right"
        try:
            batch = super().prepare(images, prompts)
        finally:
            if side is not None:
                second.padding_side = side
        self._check_qformer_prompt(batch)
        if not self.kosmos:
            order = torch.argsort(batch["attention_mask"], dim=1, stable=True)  # padding (0) first, tokens in order
            batch["input_ids"] = batch["input_ids"].gather(1, order)
            batch["attention_mask"] = batch["attention_mask"].gather(1, order)
        return batch

    def _check_qformer_prompt(self, batch: Any) -> None:
        """InstructBLIP's Q-Former reads the prompt (``qformer_input_ids``) with its own learned positions.

        Raises:
            InputError: the prompt takes more of them than the Q-Former has.
        """
        ids = batch.get("qformer_input_ids")
        limit = getattr(getattr(self.model.config, "qformer_config", None), "max_position_embeddings", None)
        if isinstance(ids, Tensor) and isinstance(limit, int) and ids.shape[1] > limit:
            raise InputError(
                f"the prompt takes {ids.shape[1]} tokens in {type(self.model).__name__}'s Q-Former, which reads it too "
                f"and has {limit} learned positions; give a shorter prompt")

    def generate(self, inputs: Any, max_len: int) -> Tensor:
        """Greedy answers; Kosmos-2's, one image at a time without its padding: its ``generate`` answers a
        left-padded prompt otherwise than the same prompt alone (transformers 5), its teacher-forced forward does not."""
        ids = inputs["input_ids"]
        if not self.kosmos or ids.shape[0] == 1 or bool(inputs["attention_mask"].all()):
            return super().generate(inputs, max_len)
        rows = []
        for b in range(ids.shape[0]):
            keep = inputs["attention_mask"][b].bool()
            one = {k: (v[b : b + 1][:, keep] if v.dim() >= 2 and v.shape[:2] == ids.shape else v[b : b + 1])
                   for k, v in inputs.items() if isinstance(v, Tensor)}
            rows.append(super().generate(one, max_len)[0])
        out = torch.full((len(rows), max(len(r) for r in rows)), self.pad_id, dtype=ids.dtype, device=ids.device)
        for b, row in enumerate(rows):
            out[b, : len(row)] = row
        return out

    def image_columns(self, inputs: Any) -> list[Tensor]:
        if not self.kosmos:
            return super().image_columns(inputs)
        return [row.nonzero()[:, 0] for row in inputs["image_embeds_position_mask"].bool()]

    def teacher_inputs(self, inputs: Any, ids: Tensor) -> dict[str, Any]:
        kwargs = super().teacher_inputs(inputs, ids)
        if self.kosmos:
            del kwargs["position_ids"]  # Kosmos-2 counts positions from the ids, as its generate does
        return kwargs

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        vision = self.model.config.vision_config
        grid = (vision.image_size // vision.patch_size, vision.image_size // vision.patch_size)
        queries = int(self.model.config.latent_query_num if self.kosmos else self.model.config.num_query_tokens)
        views = []
        for image in images:
            h, w = int(image.shape[0]), int(image.shape[1])
            box = processed_box(self.image_processor, h, w)
            views.append(ImageView((h, w), (Piece("image", grid, box, 0),), sequence_tokens=queries))
        return views

    def to_pixel_tokens(self, scores: list[Tensor], recorder: Any) -> list[Tensor]:
        """(T, queries) scores -> (T, patches) through the mean Q-Former cross-attention of each image."""
        prefix = "image_to_text_projection." if self.kosmos else "qformer."
        cross = [r for r in recorder.records if r.kind == "cross" and r.name.startswith(prefix)]
        if not cross:
            raise UnsupportedMethodError(
                "no Q-Former cross-attention was recorded, so the query tokens cannot be mapped to the patches; "
                "load the model with attn_implementation='sdpa' (or 'eager')"
            )
        vision = self.model.config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2  # keys: class token, patches (Kosmos-2: then the queries)
        attention = torch.stack([r.probs().mean(dim=1) for r in cross]).mean(dim=0)[..., 1 : 1 + patches]  # (B, Q, P)
        return [score @ attention[b].to(score.dtype) for b, score in enumerate(scores)]


@register_adapter(priority=20, family=VLM)
def _detect_qformer(model: nn.Module) -> Optional[Adapter]:
    return QFormerAdapter(model) if type(model).__name__ in _NAMES else None
