"""MiniCPM-V 4.6 and 4.7 (``MiniCPMV4_6ForConditionalGeneration``, ``MiniCPMV4_7...``): the source image, then
slices; patches merged 4 x 4 (or 2 x 2); a hybrid language model.

The image processor resizes the whole image (its aspect ratio nearly kept, sides multiples of ``patch_size`` times
the merge) into the source piece; an image larger than ``scale_resolution`` squared is also resized whole to a
``rows x cols`` canvas of equal slices (``get_sliced_grid``), cut row-major (``slice_mode``). Each piece's patches
(``target_sizes`` (h, w) per piece, packed into one sequence) are merged 2 x 2 by the vision tower's window merger
(its attention stays inside each window) and 2 x 2 again by the merger (``downsample_mode="16x"``; ``"4x"`` skips
the window merger), so each piece is a grid of (h / k, w / k) tokens, row-major; the language model sees the source
piece's tokens, then the slices', between ``<image>`` / ``<slice>`` markers and an image-id tag that carry no pixels.

MiniCPM-V 4.6's language model (Qwen3.5's) mixes tokens in linear-attention layers as well as attention layers:
``cross`` and ``cross_grad`` read the attention layers, ``cross_generic`` is refused.

MiniCPM-V 4.7 places the pieces on a canvas by 3-D (M-RoPE) positions that the model computes from
``mm_token_type_ids``, as Qwen-VL's (:mod:`~vitexplain.adapters.vlm.qwen`): the processor must give them, the
teacher-forced forward passes them extended with 0 (text) for the answer and lets the model compute its positions,
and the model's ``rope_deltas`` state is restored afterwards.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .qwen import QwenVLAdapter
from .views import ImageView, Piece

__all__ = ["MiniCPMVAdapter", "MiniCPMV47Adapter"]


class MiniCPMVAdapter(VLMAdapter):
    """``MiniCPMV4_6ForConditionalGeneration`` (see the module docstring)."""

    image_token = "<unk>"
    required_inputs = ("target_sizes",)
    required_for = "(each piece's patch grid)"

    def __init__(self, model: nn.Module, processor: Any = None) -> None:
        super().__init__(model, processor)
        self.without_attention_flow(getattr(model.config.get_text_config(), "layer_types", None) or [],
                                    "linear attention (Gated DeltaNet)")

    @property
    def _processor_name(self) -> str:
        return type(self.model).__name__.replace("ForConditionalGeneration", "Processor")

    def _merge(self) -> int:
        """k: each token's side in patches, as the processor counts them (checked against the model's mode)."""
        mode = getattr(self.image_processor, "downsample_mode", "16x")
        model_mode = getattr(self.model.config, "downsample_mode", "16x")
        if mode != model_mode:
            raise UnsupportedModelError(
                f"the processor merges patches as downsample_mode={mode!r} and {type(self.model).__name__} as "
                f"{model_mode!r}, so their image-token counts differ; pass processor_kwargs={{'downsample_mode': "
                f"{model_mode!r}}} or set model.config.downsample_mode to the processor's")
        return 2 if mode == "4x" else 4

    def prepare(self, images: Sequence[Any], prompts: Sequence[str]) -> Any:
        self._merge()
        return super().prepare(images, prompts)

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        processor = self.image_processor
        k = self._merge()
        sizes = inputs["target_sizes"].tolist()
        views, start = [], 0
        for b, image in enumerate(images):
            h, w = int(image.shape[0]), int(image.shape[1])
            grid = None
            if getattr(processor, "slice_mode", True):
                grid = processor.get_sliced_grid((h, w), int(processor.max_slice_nums), int(processor.scale_resolution))
            rows, cols = (int(grid[0]), int(grid[1])) if grid else (0, 0)
            shapes = sizes[start:start + 1 + rows * cols]
            pieces, offset = [], 0
            for index, (ph, pw) in enumerate(shapes):
                cells = (int(ph) // k, int(pw) // k)
                if index == 0:
                    pieces.append(Piece("thumbnail" if rows else "image", cells, (0.0, 0.0, float(h), float(w)), offset))
                else:
                    r, c = divmod(index - 1, cols)
                    box = (r * h / rows, c * w / cols, (r + 1) * h / rows, (c + 1) * w / cols)
                    pieces.append(Piece(f"tile {r},{c}", cells, box, offset))
                offset += cells[0] * cells[1]
            held = int((inputs["input_ids"][b] == self.image_token_id).sum())
            if offset != held or len(shapes) != 1 + rows * cols or any(s % k for shape in shapes for s in shape):
                raise UnsupportedModelError(
                    f"image {b}'s source piece and {rows} x {cols} slices {shapes} do not give its {held} image tokens; "
                    f"use the model's own {self._processor_name}, with the settings it was called with")
            start += len(shapes)
            views.append(ImageView((h, w), tuple(pieces)))
        return views


class MiniCPMV47Adapter(MiniCPMVAdapter, QwenVLAdapter):
    """``MiniCPMV4_7ForConditionalGeneration``: 4.6's geometry (:class:`MiniCPMVAdapter`), Qwen-VL's handling of positions
    the model computes from ``mm_token_type_ids`` (:class:`~vitexplain.adapters.vlm.qwen.QwenVLAdapter`: required,
    extended for the answer, ``rope_deltas`` restored)."""

    format_prompt = VLMAdapter.format_prompt  # (no vision start / end tokens: the processor puts MiniCPM's markers)
    required_inputs = ("target_sizes", "mm_token_type_ids")
    required_for = ("(each piece's patch grid, and the pieces' canvas M-RoPE positions; without them generate silently "
                    "uses 1-D positions)")
    answer_values = {"mm_token_type_ids": 0}  # the answer is text


@register_adapter(priority=20, family=VLM)
def _detect_minicpmv(model: nn.Module) -> Optional[Adapter]:
    name = type(model).__name__
    if name == "MiniCPMV4_7ForConditionalGeneration":
        return MiniCPMV47Adapter(model)
    return MiniCPMVAdapter(model) if name == "MiniCPMV4_6ForConditionalGeneration" else None
