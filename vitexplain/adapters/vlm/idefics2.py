"""Idefics2 (``Idefics2ForConditionalGeneration``): a perceiver resampler between the vision tower and the language model.

The image processor (``do_image_splitting``) cuts the original image into its four quadrants (at half its height and
width, rounded down) followed by the whole image, or keeps the whole image alone; each piece is resized on its own
(the longer side at most ``longest_edge``, each side at least ``shortest_edge``, aspect ratio kept) and padded at the
bottom and right to the batch's largest piece (``pixel_attention_mask``). The vision tower cuts each padded piece
into patches; patches not wholly inside the piece are masked. The language model's image tokens are the resampler's
``resampler_n_latents`` latents per piece, each reading every patch of its piece through the resampler's
cross-attention (keys: the piece's patches, then the latents), so a latent has no footprint of its own: as for
BLIP-2 (:mod:`~vitexplain.adapters.vlm.qformer`), the methods score the latents in the language model's sequence and
``patch scores = latent scores @ mean_{layers, heads} A[latents, patches]`` of the same forward, per piece (the
latent columns dropped: they carry no pixels; masked patches take no attention).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ...errors import UnsupportedMethodError, UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .views import ImageView, Piece

__all__ = ["ResamplerAdapter"]


def _resized(height: int, width: int, shortest: int, longest: int) -> tuple[int, int]:
    """Idefics2's resize of an (H, W) piece (``get_resize_output_image_size``)."""
    ratio = width / height
    if width >= height and width > longest:
        width, height = longest, int(longest / ratio)
    elif height > width and height > longest:
        height, width = longest, int(longest * ratio)
    return max(height, shortest), max(width, shortest)


class ResamplerAdapter(VLMAdapter):
    """``Idefics2ForConditionalGeneration`` (see the module docstring)."""

    nested_images = True

    def _pieces(self, height: int, width: int) -> list[tuple[int, int, int, int]]:
        """The (y0, x0, y1, x1) boxes of the original image that the processor's pieces cut, in sequence order."""
        if not getattr(self.image_processor, "do_image_splitting", False):
            return [(0, 0, height, width)]
        mh, mw = height // 2, width // 2
        return [(0, 0, mh, mw), (0, mw, mh, width), (mh, 0, height, mw), (mh, mw, height, width), (0, 0, height, width)]

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        processor = self.image_processor
        size = dict(processor.size)
        if not (size.get("shortest_edge") and size.get("longest_edge")) or not getattr(processor, "do_resize", True):
            raise UnsupportedModelError(f"cannot follow this image processor's resize (size={size}); use the model's own "
                                        "Idefics2ImageProcessor, which resizes between a shortest and a longest edge")
        patch = int(self.model.config.vision_config.patch_size)
        padded = tuple(int(s) for s in inputs["pixel_values"].shape[-2:])
        grid = (padded[0] // patch, padded[1] // patch)
        latents = int(self.model.config.perceiver_config.resampler_n_latents)
        views = []
        for b, image in enumerate(images):
            h, w = int(image.shape[0]), int(image.shape[1])
            pieces = []
            for k, (y0, x0, y1, x1) in enumerate(self._pieces(h, w)):
                rh, rw = _resized(y1 - y0, x1 - x0, int(size["shortest_edge"]), int(size["longest_edge"]))
                sy, sx = (y1 - y0) / rh, (x1 - x0) / rw
                box = (float(y0), float(x0), y0 + grid[0] * patch * sy, x0 + grid[1] * patch * sx)
                whole = (y0, x0, y1, x1) == (0, 0, h, w)
                name = ("image" if k == 0 else "thumbnail") if whole else f"tile {k // 2},{k % 2}"
                pieces.append(Piece(name, grid, box, k * grid[0] * grid[1], extent=(float(y0), float(x0), float(y1), float(x1))))
            held = int((inputs["input_ids"][b] == self.image_token_id).sum())
            if held != len(pieces) * latents:
                raise UnsupportedModelError(
                    f"image {b} has {held} image tokens for {len(pieces)} pieces of {latents} latents; use the model's own "
                    "Idefics2Processor, whose do_image_splitting agrees with its image processor's")
            views.append(ImageView((h, w), tuple(pieces), sequence_tokens=len(pieces) * latents))
        return views

    def to_pixel_tokens(self, scores: list[Tensor], recorder: Any) -> list[Tensor]:
        """Per image, (T, pieces * latents) -> (T, pieces * patches) through each piece's mean resampler attention."""
        prefix = "perceiver_resampler.layers."
        records = [r for r in recorder.records if prefix in r.name]
        if not records:
            raise UnsupportedMethodError(
                "no resampler attention was recorded, so the latent tokens cannot be mapped to the patches; load the model "
                "with attn_implementation='sdpa' (or 'eager')")
        attention = torch.stack([r.probs().mean(dim=1) for r in records]).mean(dim=0)  # (pieces in the batch, L, P + L)
        latents = attention.shape[1]
        patches = attention.shape[2] - latents
        out, first = [], 0
        for score in scores:
            count = score.shape[-1] // latents
            maps = attention[first:first + count, :, :patches].to(score.dtype)  # (pieces, L, P)
            per_piece = score.reshape(score.shape[0], count, latents).transpose(0, 1)  # (pieces, T, L)
            out.append((per_piece @ maps).transpose(0, 1).reshape(score.shape[0], count * patches))
            first += count
        if first != attention.shape[0]:
            raise UnsupportedModelError(f"the resampler read {attention.shape[0]} pieces, the images' tokens {first}; use "
                                        "the model's own Idefics2Processor")
        return out


@register_adapter(priority=20, family=VLM)
def _detect_idefics2(model: nn.Module) -> Optional[Adapter]:
    return ResamplerAdapter(model) if type(model).__name__ == "Idefics2ForConditionalGeneration" else None
