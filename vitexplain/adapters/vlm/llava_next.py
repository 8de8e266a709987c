"""LLaVA-NeXT and LLaVA-OneVision: a thumbnail plus any-resolution tiles.

The processor picks the best of ``image_grid_pinpoints`` for the image, resizes the image into it
keeping the aspect ratio, pads it centred, and cuts it into ``image_size`` tiles; it also resizes the
whole image to one tile (the thumbnail, "base"). The model puts the thumbnail's patch grid first,
then stitches the tiles' patch grids into one grid, removes the rows (or columns) that are padding
("unpad", computed from the original size) and appends a newline token after every row. So the
image's tokens are: the g x g thumbnail grid, row-major, then H_u rows of W_u patch tokens each
followed by one newline token (no pixels). The stitched grid covers the unpadded part of the
canvas, mapped back to the original image through the resize and the padding offset.
LLaVA-OneVision does the same and then, when the stitched grid holds more than ``anyres_max_N``
tiles' worth of patches, interpolates it down (bilinear) to a coarser grid over the same region.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

from ...errors import UnsupportedModelError
from ...methods.families import VLM
from ..base import Adapter, register_adapter
from .base import VLMAdapter
from .llava import tower_has_class_token
from .pixel_tokens import sum_cells
from .views import ImageView, Piece

__all__ = ["LlavaNextAdapter", "AnyresLayout", "anyres_layout", "anyres_view", "anyres_tokens"]


def _best_resolution(size: tuple[int, int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """transformers' ``select_best_resolution``: the (h, w) that keeps the most image pixels, then wastes the least."""
    from transformers.image_processing_utils import select_best_resolution

    return tuple(int(v) for v in select_best_resolution(size, [list(p) for p in pinpoints]))  # type: ignore[return-value]


class AnyresLayout(NamedTuple):
    """Where an image's tiles' patches go (see the module docstring).

    Attributes:
        grid: patches per tile side (``image_size // patch_size``).
        tiles: (rows, cols) tiles of the canvas.
        pad: (rows, columns) of stitched patches the model's unpad drops at each end.
        kept: (H_u, W_u) the unpadded stitched grid.
        tokens: (gh, gw) its token grid (``kept``, or OneVision's interpolated grid).
        box: (y0, x0, y1, x1) the region of the original image the unpadded grid covers.
    """

    grid: int
    tiles: tuple[int, int]
    pad: tuple[int, int]
    kept: tuple[int, int]
    tokens: tuple[int, int]
    box: tuple[float, float, float, float]


def anyres_layout(height: int, width: int, tile: int, patch: int, pinpoints: Sequence[Sequence[int]],
                  max_tiles: Optional[int] = None) -> AnyresLayout:
    """The tiles, unpadding and token grid of an (H, W) image (see the module docstring); ``max_tiles``: OneVision's
    ``anyres_max_N``, above which the unpadded grid is interpolated down (bilinear) to about N tiles."""
    grid = tile // patch
    bh, bw = _best_resolution((height, width), pinpoints)
    rows, cols = bh // tile, bw // tile
    scale_w, scale_h = bw / width, bh / height  # the processor's resize into the canvas (get_patch_output_size)
    if scale_w < scale_h:
        new_h, new_w = min(math.ceil(height * scale_w), bh), bw
    else:
        new_h, new_w = bh, min(math.ceil(width * scale_h), bw)
    paste_y, paste_x = (bh - new_h) // 2, (bw - new_w) // 2
    cur_h, cur_w = rows * grid, cols * grid  # the stitched patch grid, then the model's unpad
    pad_r = pad_c = 0
    if width / height > cur_w / cur_h:
        pad_r = (cur_h - int(round(height * (cur_w / width), 7))) // 2
    else:
        pad_c = (cur_w - int(round(width * (cur_h / height), 7))) // 2
    h_u, w_u = cur_h - 2 * pad_r, cur_w - 2 * pad_c
    grid_u = (h_u, w_u)
    if max_tiles is not None:
        ratio = math.sqrt(h_u * w_u / (max_tiles * grid**2))
        if ratio > 1.1:  # the model's own rule (LlavaOnevisionModel.pack_image_features)
            grid_u = (int(h_u // ratio), int(w_u // ratio))
    box = ((pad_r * patch - paste_y) * height / new_h, (pad_c * patch - paste_x) * width / new_w,
           ((cur_h - pad_r) * patch - paste_y) * height / new_h, ((cur_w - pad_c) * patch - paste_x) * width / new_w)
    return AnyresLayout(grid, (rows, cols), (pad_r, pad_c), (h_u, w_u), grid_u, box)


def anyres_view(height: int, width: int, tile: int, patch: int, pinpoints: Sequence[Sequence[int]],
                max_tiles: Optional[int] = None) -> ImageView:
    """The token geometry of one image (see the module docstring and :func:`anyres_layout`)."""
    layout = anyres_layout(height, width, tile, patch, pinpoints, max_tiles)
    grid, grid_u = layout.grid, layout.tokens
    base = grid * grid
    newlines = tuple(base + r * (grid_u[1] + 1) + grid_u[1] for r in range(grid_u[0]))
    pieces = (Piece("thumbnail", (grid, grid), (0.0, 0.0, float(height), float(width)), 0),
              Piece("tiles", grid_u, layout.box, base))
    return ImageView((height, width), pieces, newlines)


def anyres_tokens(cells: Tensor, layout: AnyresLayout) -> Tensor:
    """(T, n) relevance of an image's pixel-bearing tokens from (P, T, g * g) relevance per patch of its processed
    pieces (the thumbnail, then the tiles row-major, row-major patches): the thumbnail's patches, then the tiles'
    patches stitched into one grid, the unpadded rows / columns dropped, each kept patch summed into the token whose
    cell of ``layout.tokens`` over the kept grid holds the patch's centre (the footprint :func:`render` draws; a
    token of OneVision's interpolated grid mixes its neighbours' patches bilinearly, its own are these)."""
    g = layout.grid
    (rows, cols), (pad_r, pad_c), (h_u, w_u), (gh, gw) = layout.tiles, layout.pad, layout.kept, layout.tokens
    t = cells.shape[1]
    stitched = cells[1: 1 + rows * cols].reshape(rows, cols, t, g, g).permute(2, 0, 3, 1, 4).reshape(t, rows * g, cols * g)
    kept = stitched[:, pad_r: pad_r + h_u, pad_c: pad_c + w_u]  # (T, H_u, W_u)
    row = ((torch.arange(h_u, dtype=torch.float64) + 0.5) * gh / h_u).floor().long()  # each kept row's token row
    col = ((torch.arange(w_u, dtype=torch.float64) + 0.5) * gw / w_u).floor().long()
    index = (row[:, None] * gw + col[None, :]).flatten().to(cells.device)  # (H_u * W_u,)
    tokens = cells.new_zeros(t, gh * gw).index_add_(1, index, kept.reshape(t, -1))
    return torch.cat([cells[0], tokens], dim=1)


class LlavaNextAdapter(VLMAdapter):
    """LLaVA-NeXT (LLaVA-1.6) and LLaVA-OneVision (``onevision=True``: the stitched grid may be
    interpolated down, ``vision_aspect_ratio="anyres_max_N"``)."""

    def __init__(self, model: nn.Module, processor: Any = None, onevision: bool = False) -> None:
        super().__init__(model, processor)
        self.onevision = onevision

    def _geometry(self) -> tuple[int, int, Optional[int]]:
        """(tile px, patch px, OneVision's ``anyres_max_N`` or None), the processor's tiles checked against the model's.

        Raises:
            UnsupportedModelError: a setting whose token geometry is not followed, or a processor cutting other tiles.
        """
        config = self.model.config
        tile, patch = config.vision_config.image_size, config.vision_config.patch_size
        max_tiles = None
        if self.onevision:
            aspect = str(config.vision_aspect_ratio)
            if not aspect.startswith("anyres_max_"):
                raise UnsupportedModelError(f"LLaVA-OneVision with vision_aspect_ratio={aspect!r} is not supported")
            max_tiles = int(aspect[len("anyres_max_"):])
        elif config.vision_feature_select_strategy != "default" and tower_has_class_token(self.model):
            # ("full" on a tower without a class token, SigLIP, keeps each tile's g x g patches, as "default" on CLIP)
            raise UnsupportedModelError("LLaVA-NeXT with the 'full' feature strategy on a vision tower with a class token "
                                        "(a class token per tile) is not supported")
        processor = self.image_processor
        crop = dict(getattr(processor, "crop_size", None) or {})
        if crop and crop.get("height") != tile:
            raise UnsupportedModelError(f"the processor's {crop} tiles differ from the vision tower's {tile} px input")
        cuts = getattr(processor, "image_grid_pinpoints", None)  # (the processor cuts by its own, the model stitches by its)
        if cuts is not None and [list(p) for p in cuts] != [list(p) for p in config.image_grid_pinpoints]:
            raise UnsupportedModelError(
                f"the processor cuts tiles by image_grid_pinpoints {[list(p) for p in cuts]}, but the model stitches them "
                f"back by its config's {[list(p) for p in config.image_grid_pinpoints]}; use the model's own processor "
                "settings (no image_grid_pinpoints in processor_kwargs)")
        return int(tile), int(patch), max_tiles

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        tile, patch, max_tiles = self._geometry()
        pinpoints = self.model.config.image_grid_pinpoints
        return [anyres_view(int(image.shape[0]), int(image.shape[1]), tile, patch, pinpoints, max_tiles)
                for image in images]

    def lrp_pixels(self, kwargs: Any) -> str:
        """The processor's tiles (``pixel_values``, (B, P, C, H, W): the thumbnail, then the tiles; zero padding)."""
        if "pixel_values" not in kwargs or kwargs["pixel_values"].dim() != 5:
            raise UnsupportedModelError(f"the teacher-forced forward of {type(self.model).__name__} holds no (B, P, C, H, W) "
                                        "pixel_values of tiles; use the model's own processor")
        return "pixel_values"

    def lrp_tokens(self, relevance: Tensor, counts: Sequence[int], inputs: Any = None) -> list[Tensor]:
        """Per image, (T, n_b) relevance of its pixel-bearing tokens from (B, T, P, H, W) relevance at its pieces' pixels:
        each patch's pixels summed, then placed as the model packs the patches (:func:`anyres_tokens`; the newline tokens
        have no pixels and are not among them; the batch's padding pieces, which the model does not read, are left out).

        Raises:
            UnsupportedModelError: an image holds another number of tokens than its layout gives.
        """
        tile, patch, max_tiles = self._geometry()
        sizes = inputs["image_sizes"].tolist()
        out = []
        for b, n in enumerate(counts):
            layout = anyres_layout(int(sizes[b][0]), int(sizes[b][1]), tile, patch, self.model.config.image_grid_pinpoints,
                                   max_tiles)
            pieces = 1 + layout.tiles[0] * layout.tiles[1]
            cells = sum_cells(relevance[b, :, :pieces].transpose(0, 1), (layout.grid, layout.grid),
                              type(self.model).__name__)  # (P, T, g * g)
            tokens = anyres_tokens(cells, layout)
            if tokens.shape[1] != n:
                raise UnsupportedModelError(f"image {b} has {n} pixel-bearing image tokens, but the tiles of its "
                                            f"{sizes[b][0]}x{sizes[b][1]} size give {tokens.shape[1]}; use the model's own processor")
            out.append(tokens)
        return out


@register_adapter(priority=20, family=VLM)
def _detect_llava_next(model: nn.Module) -> Optional[Adapter]:
    name = type(model).__name__
    if name in ("LlavaNextForConditionalGeneration", "LlavaNextVideoForConditionalGeneration"):  # (Video: its images)
        adapter = LlavaNextAdapter(model)
    elif name == "LlavaOnevisionForConditionalGeneration":
        adapter = LlavaNextAdapter(model, onevision=True)
    else:
        return None
    adapter.capabilities = adapter.capabilities | {"lrp"}  # (checked against a hand-written oracle)
    adapter.notes.pop("lrp", None)
    return adapter
