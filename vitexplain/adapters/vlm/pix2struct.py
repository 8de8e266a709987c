"""Pix2Struct (``Pix2StructForConditionalGeneration``): an encoder over variable-resolution patches, a text decoder.

The image processor normalises each image, resizes it (bilinear) to ``rows x cols`` patches, the
largest grid of its aspect ratio that fits ``max_patches``, and flattens the patches row-major,
each prefixed with its 1-based row and column id; the rest, up to ``max_patches``, is zero padding
(masked). So patch ``(r, c)`` covers rows ``[r, r + 1) * H / rows`` and columns ``[c, c + 1) * W / cols``
of the original image, and its encoder position is ``r * cols + c``; rows and cols are read back from
the ids the processor wrote. The prompt (captioning checkpoints) is the decoder's prefix after the
decoder start token, left-padded (the decoder's relative position bias does not see the shift).

VQA checkpoints (``is_vqa``) take the prompt as a header: the processor renders the question (with
its font) above the image, scaled to the wider of the two, into one canvas whose patches the encoder
reads, and the decoder starts from its start token alone. The patch grid then covers the canvas: in
the original image's coordinates it starts ``header height * H / scaled image height`` above the
image; the header's patches hold no pixels of the image (their scores stay in ``token_scores``), a
patch across the border covers the image pixels under it. The header's size comes from the image
processor's own ``render_header`` (which loads the processor's font, as its preprocessing does).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ...errors import InputError, UnsupportedModelError, UsageError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import processor_images
from .views import ImageView, Piece
from .encdec import EncoderDecoderVLMAdapter

__all__ = ["Pix2StructAdapter"]

def _vqa(model: nn.Module) -> bool:
    return bool(getattr(model.config, "is_vqa", False) or getattr(model.config.vision_config, "is_vqa", False))


class Pix2StructAdapter(EncoderDecoderVLMAdapter):
    """``Pix2StructForConditionalGeneration`` (encoder: the patch encoder; VQA checkpoints: the question as a header)."""

    def __init__(self, model: nn.Module, processor: Any = None) -> None:
        super().__init__(model, processor)
        self._headers: list[str] = []  # the VQA questions of the last prepare() (views() measures their header)

    @property
    def image_token_id(self) -> int:
        raise UnsupportedModelError("Pix2Struct has no image token: its encoder's sequence is the image's patches")

    @property
    def placeholder_ids(self) -> list[int]:
        return []

    def format_prompt(self, prompt: str) -> str:
        return prompt

    def prepare(self, images: Sequence[Any], prompts: Sequence[str]) -> Any:
        """The processor's patches (its own ``max_patches``, or ``processor_kwargs``') and the decoder prefix ``[start] + prompt``, left-padded."""
        processor = self.require_processor()
        image_processor = self.image_processor  # (processor_kwargs applied)
        vqa = _vqa(self.model)
        if bool(getattr(image_processor, "is_vqa", False)) != vqa:
            raise UnsupportedModelError(
                f"the model is {'a' if vqa else 'not a'} Pix2Struct VQA checkpoint but its image processor has "
                f"is_vqa={getattr(image_processor, 'is_vqa', False)}; pass the model's own processor")
        text = {"text": list(prompts)} if vqa else {}  # VQA: the question is rendered above the image
        self._headers = list(prompts) if vqa else []
        settings = {"max_patches": image_processor.max_patches, **self.processor_kwargs}
        batch = processor(images=processor_images(images), return_tensors="pt", **settings, **text)
        start = [self.decoder_start_id]
        prefixes = [start + self.encode_answer(p) if p and not vqa else start for p in prompts]
        length = max(len(p) for p in prefixes)
        ids = [[self.pad_id] * (length - len(p)) + p for p in prefixes]
        mask = [[0] * (length - len(p)) + [1] * len(p) for p in prefixes]
        device = next(self.model.parameters()).device
        batch = batch.to(device)
        batch["flattened_patches"] = self._in_model_dtype(batch["flattened_patches"])
        batch["decoder_input_ids"] = torch.tensor(ids, dtype=torch.long, device=device)
        batch["decoder_attention_mask"] = torch.tensor(mask, dtype=torch.long, device=device)
        return batch

    def _in_model_dtype(self, patches: Tensor) -> Tensor:
        """(B, P, 2 + D) patches in the dtype of the model's patch projection (a half-precision model's; the model
        does not cast them itself), once the row and column ids they carry are checked to survive that dtype.

        Raises:
            InputError: the ids are too large for the dtype (bfloat16: past 256).
        """
        dtype = self.linear_dtype("embeddings.patch_projection")
        if dtype is None or dtype == patches.dtype:
            return patches
        cast = patches.to(dtype)
        if not torch.equal(cast[..., :2].to(patches.dtype), patches[..., :2]):
            raise InputError(
                f"the patches' row and column ids reach {int(patches[..., :2].max())}, which a {str(dtype).replace('torch.', '')} "
                "Pix2Struct cannot hold exactly (it reads them from its patches); explain with the model in float32, or "
                "pass a smaller max_patches (processor_kwargs) or a less elongated image")
        return cast

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
            if _vqa(self.model) and len(self._headers) != len(images):
                raise UsageError("Pix2Struct VQA: call prepare() with these images' questions before views()")
            top = -self._header_height(h, w, self._headers[b]) if _vqa(self.model) else 0.0
            views.append(ImageView((h, w), (Piece("image", self._grid(inputs, b), (top, 0.0, float(h), float(w)), 0),)))
        return views

    def _header_height(self, height: int, width: int, prompt: str) -> float:
        """How far above an (H, W) image, in its own pixels, the VQA canvas starts (the rendered header's height)."""
        image_processor = self.image_processor
        blank = torch.zeros(3, height, width, dtype=torch.uint8)
        canvas = image_processor.render_header(blank.numpy() if "Pil" in type(image_processor).__name__ else blank, prompt)
        canvas_height, canvas_width = int(canvas.shape[-2]), int(canvas.shape[-1])
        scaled = int(height * (canvas_width / width))  # the image's height in the canvas (transformers' rounding)
        return (canvas_height - scaled) * height / scaled


@register_adapter(priority=20, family=VLM)
def _detect_pix2struct(model: nn.Module) -> Optional[Adapter]:
    if type(model).__name__ != "Pix2StructForConditionalGeneration":
        return None
    return Pix2StructAdapter(model)
