"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (and GLM-4.1V and EXAONE 4.5, which share their geometry): dynamic
resolution, 2 x 2 patch merge, M-RoPE (EXAONE 4.5: 1-D positions).

The processor resizes the whole image (no crop) to multiples of ``patch_size * merge_size`` and
gives ``image_grid_thw`` (1, gh, gw) in patches; the language model sees one token per 2 x 2
block of patches, in row-major order of the blocks. Qwen2.5-VL's vision tower runs its window
attention on patches reordered window by window and restores the row-major order before the
language model (checked by the footprint probe in ``tests/test_vlm.py``). Qwen3-VL adds the
"deepstack" features of the same tokens to early language-model layers.

Positions are the model's 3-D M-RoPE positions, computed from ``mm_token_type_ids``: the
processor must give them (without them ``generate`` falls back to 1-D positions and, for
Qwen3-VL, changes the answer), so their absence is an error. The teacher-forced forward passes
them extended with 0 (text) for the answer and lets the model compute its own positions, as it
does for ``generate``'s first step. The model's ``rope_deltas`` state, which its forward sets,
is restored afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

from torch import Tensor, nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .views import ImageView, Piece

__all__ = ["QwenVLAdapter", "Qwen35Adapter", "Glm4vAdapter", "Exaone45Adapter"]

_NAMES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
          "Qwen3VLMoeForConditionalGeneration")


class QwenVLAdapter(VLMAdapter):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL (``*ForConditionalGeneration``)."""

    image_token = "<|image_pad|>"
    image_open, image_close = "<|vision_start|>", "<|vision_end|>"  # the tokens around the image's
    required_inputs = ("mm_token_type_ids",)
    required_for = ("for its 3-D (M-RoPE) positions; without them generate silently uses 1-D positions and the answer "
                    "changes")
    answer_values = {"mm_token_type_ids": 0}  # the answer is text

    def format_prompt(self, prompt: str) -> str:
        token = getattr(self.processor, "image_token", None) or self.image_token
        return prompt if token in prompt else f"{self.image_open}{token}{self.image_close}{prompt}"

    @contextmanager
    def _rope_state(self) -> Iterator[None]:
        inner = getattr(self.model, "model", self.model)
        saved = getattr(inner, "rope_deltas", None)
        try:
            yield
        finally:
            inner.rope_deltas = saved

    def generate(self, inputs: Any, max_len: int) -> Tensor:
        with self._rope_state():
            return super().generate(inputs, max_len)

    def teacher_inputs(self, inputs: Any, ids: Tensor) -> dict[str, Any]:
        kwargs = super().teacher_inputs(inputs, ids)
        del kwargs["position_ids"]  # the model computes its 3-D positions from the ids and mm_token_type_ids
        return kwargs

    def forward_logits(self, kwargs: dict[str, Any]) -> Tensor:
        with self._rope_state():
            return super().forward_logits(kwargs)

    def lrp_pixels(self, kwargs: Any) -> str:
        return "pixel_values"

    def lrp_tokens(self, relevance: Tensor, counts: Sequence[int], inputs: Any = None) -> list[Tensor]:
        """Per image, (T, n_b) relevance of its tokens from (P, T) relevance per flattened patch (the processor's
        ``pixel_values`` rows, channels, frames and pixels summed): the processor lays each image's patches out merge
        block by merge block (``merge**2`` consecutive rows per token, blocks row-major), images one after another.

        Raises:
            UnsupportedModelError: the patches do not add up to the images' tokens.
        """
        block = int(self.model.config.vision_config.spatial_merge_size) ** 2
        if relevance.dim() != 2 or relevance.shape[0] != block * sum(counts):
            raise UnsupportedModelError(f"{type(self.model).__name__}: {tuple(relevance.shape)} patch relevance for "
                                        f"{sum(counts)} image tokens of {block} patches each")
        out, start = [], 0
        for n in counts:
            part = relevance[start: start + n * block]  # (n * block, T)
            out.append(part.reshape(n, block, -1).sum(dim=1).t())
            start += n * block
        return out

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        merge = int(self.model.config.vision_config.spatial_merge_size)
        grids = inputs["image_grid_thw"].tolist()
        if len(grids) != len(images):
            raise UnsupportedModelError(f"{len(grids)} image grids for {len(images)} images")
        views = []
        for image, (frames, gh, gw) in zip(images, grids):
            if frames != 1:
                raise UnsupportedModelError("Qwen-VL video inputs are not supported; explain single images")
            h, w = int(image.shape[0]), int(image.shape[1])
            views.append(ImageView((h, w), (Piece("image", (gh // merge, gw // merge), (0.0, 0.0, float(h), float(w)), 0),)))
        return views


class Qwen35Adapter(QwenVLAdapter):
    """Qwen3.5 and Qwen3.5-MoE (``Qwen3_5*ForConditionalGeneration``): Qwen3-VL's tower, processor and M-RoPE, and a
    hybrid language model whose layers are mostly linear attention (Gated DeltaNet) with a softmax attention layer
    every few (``config.text_config.layer_types``).

    Only the softmax layers have attention rows over the image tokens: ``cross`` and ``cross_grad`` read those
    (their ``layers`` index them, the first full-attention layer being 0); ``cross_generic`` is refused, since the
    linear-attention layers mix tokens with no attention matrix to carry relevance through.
    """

    def __init__(self, model: nn.Module, processor: Any = None) -> None:
        super().__init__(model, processor)
        self.without_attention_flow(getattr(model.config.get_text_config(), "layer_types", None) or [],
                                    "linear attention (Gated DeltaNet)")


class Glm4vAdapter(QwenVLAdapter):
    """GLM-4.1V, GLM-4.5V (experts), GLM-4.6V and GLM-OCR (``Glm4v*``, ``Glm46V*``, ``GlmOcrForConditionalGeneration``): Qwen2-VL's geometry (``image_grid_thw``, 2 x 2
    merge, M-RoPE from ``mm_token_type_ids``), its image between ``<|begin_of_image|>`` and ``<|end_of_image|>``."""

    image_token = "<|image|>"
    image_open, image_close = "<|begin_of_image|>", "<|end_of_image|>"


class Exaone45Adapter(QwenVLAdapter):
    """EXAONE 4.5 (``Exaone4_5_ForConditionalGeneration``): Qwen2.5-VL's tower, merge and geometry (``image_grid_thw``),
    with 1-D positions (no M-RoPE, so no ``mm_token_type_ids``): positions that skip the left padding, as ``generate``
    counts them; the prompt holds the image token alone."""

    required_inputs: tuple[str, ...] = ()
    answer_values: dict[str, int] = {}
    teacher_inputs = VLMAdapter.teacher_inputs  # (positions that skip the left padding)
    format_prompt = VLMAdapter.format_prompt


@register_adapter(priority=20, family=VLM)
def _detect_qwen(model: nn.Module) -> Optional[Adapter]:
    if type(model).__name__ == "Exaone4_5_ForConditionalGeneration":
        return Exaone45Adapter(model)
    if type(model).__name__ in ("Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration",
                                "Glm46VForConditionalGeneration", "GlmOcrForConditionalGeneration"):
        return Glm4vAdapter(model)
    if type(model).__name__ in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        return Qwen35Adapter(model)
    if type(model).__name__ not in _NAMES:
        return None
    adapter = QwenVLAdapter(model)
    if type(model).__name__ in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                                "Qwen3VLForConditionalGeneration"):
        adapter.capabilities = adapter.capabilities | {"lrp"}  # (checked against a hand-written oracle)
        adapter.notes.pop("lrp", None)
    return adapter
