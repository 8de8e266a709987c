"""Pix2Struct (``Pix2StructForConditionalGeneration``): an encoder over variable-resolution patches, a text decoder.

The image processor normalises each image, resizes it (bilinear) to ``rows x cols`` patches, the
largest grid of its aspect ratio that fits ``max_patches``, and flattens the patches row-major,
each prefixed with its 1-based row and column id; the rest, up to ``max_patches``, is zero padding
(masked). So patch ``(r, c)`` covers rows ``[r, r + 1) * H / rows`` and columns ``[c, c + 1) * W / cols``
of the original image, and its encoder position is ``r * cols + c``; rows and cols are read back from
the ids the processor wrote. The prompt (captioning checkpoints) is the decoder's prefix after the
decoder start token, left-padded (the decoder's relative position bias does not see the shift).

VQA checkpoints (``is_vqa``) render the question as a header above the image, which needs a font and
moves the image inside the rendered canvas: refused with that reason.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import ImageView, Piece
from .encdec import EncoderDecoderVLMAdapter, refused_variant

__all__ = ["Pix2StructAdapter", "VQA_REASON"]

VQA_REASON = ("Pix2Struct VQA checkpoints (is_vqa) render the question as a header above the image (with a font "
              "downloaded at run time) and rescale the image inside that canvas; that geometry is not mapped back to "
              "the image yet: explain a captioning checkpoint, or pass the question as the decoder prompt of one")


class Pix2StructAdapter(EncoderDecoderVLMAdapter):
    """``Pix2StructForConditionalGeneration`` with ``is_vqa=False`` (encoder: the patch encoder)."""

    @property
    def image_token_id(self) -> int:
        raise UnsupportedModelError("Pix2Struct has no image token: its encoder's sequence is the image's patches")

    @property
    def placeholder_ids(self) -> list[int]:
        return []

    def format_prompt(self, prompt: str) -> str:
        return prompt

    def prepare(self, images: Sequence[Any], prompts: Sequence[str]) -> Any:
        """The processor's patches (its own ``max_patches``) and the decoder prefix ``[start] + prompt``, left-padded."""
        processor = self.require_processor()
        image_processor = processor.image_processor
        if getattr(image_processor, "is_vqa", False):
            raise UnsupportedModelError(VQA_REASON)
        batch = processor(images=list(images), return_tensors="pt", max_patches=image_processor.max_patches)
        prefixes = [[self.decoder_start_id] + self.encode_answer(p) if p else [self.decoder_start_id] for p in prompts]
        length = max(len(p) for p in prefixes)
        ids = [[self.pad_id] * (length - len(p)) + p for p in prefixes]
        mask = [[0] * (length - len(p)) + [1] * len(p) for p in prefixes]
        device = next(self.model.parameters()).device
        batch = batch.to(device)
        batch["decoder_input_ids"] = torch.tensor(ids, dtype=torch.long, device=device)
        batch["decoder_attention_mask"] = torch.tensor(mask, dtype=torch.long, device=device)
        return batch

    def decoder_prefix_ids(self, inputs: Any) -> tuple[Tensor, Tensor]:
        return inputs["decoder_input_ids"], inputs["decoder_attention_mask"]

    def _grid(self, inputs: Any, b: int) -> tuple[int, int]:
        """(rows, cols) of image b, from the row and column ids the processor wrote (padding: 0)."""
        patches = inputs["flattened_patches"][b]
        rows, cols = int(patches[:, 0].max()), int(patches[:, 1].max())
        real = int(inputs["attention_mask"][b].sum())
        if rows * cols != real:
            raise UnsupportedModelError(
                f"Pix2Struct image {b}: the patch ids say {rows} x {cols} patches but the mask holds {real}; "
                "pass the model's own processor")
        return rows, cols

    def image_columns(self, inputs: Any) -> list[Tensor]:
        device = inputs["flattened_patches"].device
        return [torch.arange(r * c, device=device) for r, c in (self._grid(inputs, b) for b in range(len(inputs["flattened_patches"])))]

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        views = []
        for b, image in enumerate(images):
            h, w = int(image.shape[0]), int(image.shape[1])
            views.append(ImageView((h, w), (Piece("image", self._grid(inputs, b), (0.0, 0.0, float(h), float(w)), 0),)))
        return views


@register_adapter(priority=20, family=VLM)
def _detect_pix2struct(model: nn.Module) -> Optional[Adapter]:
    if type(model).__name__ != "Pix2StructForConditionalGeneration":
        return None
    if getattr(model.config, "is_vqa", False) or getattr(model.config.vision_config, "is_vqa", False):
        return refused_variant(model, VQA_REASON)
    return Pix2StructAdapter(model)
