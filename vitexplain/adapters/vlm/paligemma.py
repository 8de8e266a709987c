"""PaliGemma and Gemma 3: a SigLIP tower over the whole resized image, a prefix-LM mask.

PaliGemma: one image token per SigLIP patch (``image_seq_length`` of them). Gemma 3: the patch
grid average-pooled to ``mm_tokens_per_image`` tokens (a square grid). Both resize the whole image
(no crop), so the token grid covers the whole original image, and both mark the prompt (image
included) with ``token_type_ids`` 0 and answer tokens with 1 (the prefix attends both ways, the
answer causally); Gemma 3 marks its image tokens with 1 (they attend to each other both ways) and
text with 0. The teacher-forced answer tokens get what ``generate`` gives its generated tokens. Gemma 3's sliding-window layers keep their own mask in the one
teacher-forced call (nothing is stitched across generation steps). PaliGemma counts positions
from 1.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from torch import Tensor, nn

from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .pixel_tokens import batch_piece_tokens
from .views import ImageView, Piece, processed_box

__all__ = ["PrefixLMAdapter", "pan_and_scan_boxes"]


class PrefixLMAdapter(VLMAdapter):
    """``PaliGemmaForConditionalGeneration`` (``kind="paligemma"``) and ``Gemma3ForConditionalGeneration`` (``"gemma3"``)."""

    def __init__(self, model: nn.Module, kind: str, processor: Any = None) -> None:
        super().__init__(model, processor)
        self.kind = kind
        self.position_offset = 1 if kind == "paligemma" else 0
        self.nested_images = kind == "gemma3"
        self.required_inputs = ("token_type_ids",)
        self.required_for = ("for its prefix mask (PaliGemma: image and prompt attend both ways; Gemma 3: the image "
                             "tokens do)")
        # the answer tokens as generate gives them: PaliGemma's 1 = the causal suffix; Gemma 3's 0 = text (1 = image)
        self.answer_values = {"token_type_ids": 1 if kind == "paligemma" else 0}

    def format_prompt(self, prompt: str) -> str:
        if self.kind == "paligemma":
            return super().format_prompt(prompt)  # the processor puts <bos> after the image tokens
        token = getattr(self.processor, "boi_token", None) or "<start_of_image>"
        return prompt if token in prompt else f"{token}{prompt}"

    def grid(self) -> tuple[int, int]:
        config = self.model.config
        if self.kind == "gemma3":
            side = math.isqrt(int(config.mm_tokens_per_image))
            return side, side
        vision = config.vision_config
        size = vision.image_size
        return size // vision.patch_size, size // vision.patch_size

    def lrp_pixels(self, kwargs: Any) -> str:
        return "pixel_values"

    def lrp_tokens(self, relevance: Tensor, counts: Sequence[int], inputs: Any = None) -> list[Tensor]:
        """Per image, (T, n_b) relevance of its tokens: (P, T, H, W) pixel relevance of the resized pieces summed over each
        cell of the token grid (a SigLIP patch; Gemma 3: an average-pooled block of patches); an image's pieces are the
        whole image, then its pan-and-scan crops (Gemma 3), one grid each, in the sequence's order.

        Raises:
            UnsupportedModelError: the tokens are not whole grids of the pieces' pixels.
        """
        return batch_piece_tokens(relevance, counts, self.grid(), type(self.model).__name__)

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        grid = self.grid()
        per_image = grid[0] * grid[1]
        views = []
        for b, image in enumerate(images):
            h, w = int(image.shape[0]), int(image.shape[1])
            pieces = [Piece("image", grid, processed_box(self.image_processor, h, w), 0)]
            if self.kind == "gemma3":  # pan-and-scan crops follow the whole image in the sequence
                held = int((inputs["input_ids"][b] == self.image_token_id).sum())
                for k, box in enumerate(pan_and_scan_boxes(h, w, max(held // per_image - 1, 0))):
                    pieces.append(Piece(f"crop {k + 1}", grid, box, (k + 1) * per_image))
            views.append(ImageView((h, w), tuple(pieces)))
        return views


def pan_and_scan_boxes(height: int, width: int, crops: int) -> list[tuple[float, float, float, float]]:
    """The (y0, x0, y1, x1) boxes of the ``crops`` pieces Gemma 3's pan-and-scan cuts from an (H, W) image.

    As transformers' ``Gemma3ImageProcessor.pan_and_scan_batched``: a landscape (or square) image is
    cut along its width into crops ``ceil(W / crops)`` wide, a portrait one along its height; the last
    crop ends at the image's edge. How many crops there are is read from the sequence (each crop adds
    one grid of tokens), so the processor's settings need not be known here.
    """
    if crops <= 0:
        return []
    if width >= height:
        step = math.ceil(width / crops)
        return [(0, i * step, height, min((i + 1) * step, width)) for i in range(crops)]
    step = math.ceil(height / crops)
    return [(i * step, 0, min((i + 1) * step, height), width) for i in range(crops)]


@register_adapter(priority=20, family=VLM)
def _detect_prefix_lm(model: nn.Module) -> Optional[Adapter]:
    name = type(model).__name__
    kinds = {"PaliGemmaForConditionalGeneration": "paligemma", "Gemma3ForConditionalGeneration": "gemma3"}
    if name not in kinds:
        return None
    adapter = PrefixLMAdapter(model, kinds[name])
    text = model.config.get_text_config()
    softcaps = [getattr(text, key, None) for key in ("attn_logit_softcapping", "final_logit_softcapping")]
    if all(cap is None for cap in softcaps):  # (PaliGemma 2's Gemma 2 caps scores with a tanh: no rule checked for it)
        adapter.capabilities = adapter.capabilities | {"lrp"}  # (checked against a hand-written oracle)
        adapter.notes.pop("lrp", None)
    else:
        adapter.notes["lrp"] = (f"{name}'s language model soft-caps its attention scores or logits with a tanh (Gemma 2), for "
                                "which no AttnLRP rule is checked; use cross_generic or cross_grad")
    return adapter
