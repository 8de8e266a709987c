"""Florence-2 (``Florence2ForConditionalGeneration``): DaViT -> image tokens + prompt -> BART encoder -> decoder.

The processor writes ``<image> x N`` + ``<s>`` + prompt + ``</s>`` (right padding: BART's learned
positions count from the first token, so the real tokens keep their positions) and resizes the image
to its ``size`` (no crop). The projector turns DaViT's last-stage feature map (gh x gw) into
``1 + gh * gw`` image tokens: first a **pooled** token (the mean of all grid tokens, so every pixel
reaches it: it is spread over the whole image, its own piece ``"pooled"``), then the grid in
row-major order. The BART encoder mixes those tokens with the prompt; the decoder reads them
through cross-attention, whose image columns are the image-token positions.

DaViT's patch embeddings are overlapping strided convolutions (7x7 stride 4, then 3x3 stride 2), so
each grid token's receptive field spans about two cells and is centred on the top-left corner of the
uniform cell (at pixel ``a + S * j`` with S the total stride), not on the cell centre: a pixel is
given to the token whose receptive-field centre is nearest (cells of S pixels centred on those
centres; the strips past the last centre take the edge token, ``Piece.clamp``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .views import ImageView, Piece, processed_box
from .encdec import EncoderDecoderVLMAdapter

__all__ = ["Florence2Adapter", "davit_geometry"]


def davit_geometry(config: Any, size: int, axis: int) -> tuple[int, float, int]:
    """Along one axis of a ``size``-pixel input: the last stage's token count, the receptive-field centre
    of token 0 (in pixel coordinates, pixel i spanning [i, i + 1)) and the total stride.

    Each stage's convolution maps token j to the input position ``j * stride - padding + (kernel - 1) / 2``.
    """
    count, offset, stride = size, 0.5, 1
    for kernel, step, pad in zip(config.patch_size, config.patch_stride, config.patch_padding):
        k = kernel if isinstance(kernel, int) else kernel[axis]
        count = (count + 2 * pad - k) // step + 1
        offset += stride * (-pad + (k - 1) / 2)
        stride *= step
    return count, offset, stride


class Florence2Adapter(EncoderDecoderVLMAdapter):
    """``Florence2ForConditionalGeneration`` (encoder: the BART encoder over image + prompt tokens)."""

    padding_side = "right"

    def __init__(self, model: nn.Module, processor: Any = None) -> None:
        super().__init__(model, processor)
        self.encoder_prefix = self._find("encoder")
        self.decoder_prefix = self._find("decoder")

    def _find(self, part: str) -> str:
        for name, module in self.model.named_modules():
            if name.endswith("language_model." + part):
                return name
        raise UnsupportedModelError(f"Florence-2 without a language_model.{part}: not a transformers Florence-2 build")

    def format_prompt(self, prompt: str) -> str:
        return self.bare_prompt(prompt)  # the processor puts the image tokens and <s> in front and </s> after

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        if getattr(self.image_processor, "do_center_crop", False):
            raise UnsupportedModelError("Florence-2's processor resizes the whole image; this one centre-crops it, "
                                        "which the token geometry does not follow (set do_center_crop=False)")
        vision = self.model.config.vision_config
        rh, rw = int(inputs["pixel_values"].shape[-2]), int(inputs["pixel_values"].shape[-1])
        gh, top, sy = davit_geometry(vision, rh, 0)
        gw, left, sx = davit_geometry(vision, rw, 1)
        views = []
        for image in images:
            h, w = int(image.shape[0]), int(image.shape[1])
            y0, x0, y1, x1 = processed_box(self.image_processor, h, w)  # the original box the resize keeps
            fy, fx = (y1 - y0) / rh, (x1 - x0) / rw
            cells = (y0 + (top - sy / 2) * fy, x0 + (left - sx / 2) * fx,
                     y0 + (top - sy / 2 + gh * sy) * fy, x0 + (left - sx / 2 + gw * sx) * fx)
            views.append(ImageView((h, w), (Piece("pooled", (1, 1), (y0, x0, y1, x1), 0),
                                            Piece("image", (gh, gw), cells, 1, clamp=True))))
        return views


@register_adapter(priority=20, family=VLM)
def _detect_florence(model: nn.Module) -> Optional[Adapter]:
    return Florence2Adapter(model) if type(model).__name__ == "Florence2ForConditionalGeneration" else None
