"""What an explanation returns: :class:`Explanation` (one method, one batch of images) and
:class:`CaptionExplanation` (one method, per-word maps of a batch of captions).

Both check their shapes when built: a map per image (the first dimension is the batch size
B), so ``e.maps[i]`` is always image i's map.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import Tensor

from .errors import CaptureError, UsageError
from .layout import TokenLayout
from .placement import covered_pixels, crop_of, drawable, pasted, upsampled
from .saved import (boxes_from_json, boxes_json, extras_json, json_options, json_sources, layout_from_json, layout_json,
                    read_saved, write_saved)
from .viz._util import image_index as _image_index

__all__ = ["Explanation", "CaptionExplanation", "VLMCaptionExplanation"]


@dataclass(repr=False)
class Explanation:
    """The maps of one method for one batch.

    Attributes:
        maps: (B, gh, gw) float32 on the model's device; signed for signed methods.
        targets: (B,) long, the explained classes (-1 for a custom score).
        method: method name.
        options: the method options used.
        logits: the model outputs of the explained forward (detached logits when found).
        signed: whether maps are signed (overlay with ``normalize="signed"``).
        input_size: (H, W) of the model input.
        layout: token layout (ViTs) or None.
        images: when images (not tensors) were explained: the (H, W, 3) uint8 RGB regions
            the model saw (after resize and crop), one per image.
        sources: the inputs as given (paths, or None), when images were explained.
        label_names: the model's class names, if known.
        extras: method-specific results besides the maps (e.g. the ``channel`` method's
            top-k channels and gate values); empty for most methods.
        score_name: the name of the score explained when the target was a callable (targets -1), e.g.
            ``"norm"`` for ``vx.targets.norm()``; None for class targets.
    """

    maps: Tensor
    targets: Tensor
    method: str
    options: dict[str, Any]
    logits: Any
    signed: bool
    input_size: tuple[int, int]
    layout: Optional[TokenLayout] = None
    images: Optional[list[Any]] = None
    sources: Optional[list[Any]] = None
    label_names: Optional[list[str]] = None
    boxes: Optional[list[Any]] = field(default=None, repr=False)
    extras: dict[str, Any] = field(default_factory=dict, repr=False)
    score_name: Optional[str] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        batch = _batch_size(self.targets, "targets", self.method)
        _check_maps(self.maps, batch, 3, "(B, h, w)", self.method)

    def __len__(self) -> int:
        return int(self.maps.shape[0])

    def __repr__(self) -> str:
        """One line: method, map shape, targets (the dataclass's repr printed every map and logit value)."""
        return (f"{type(self).__name__}(method={self.method!r}, maps={_shape(self.maps)}, signed={self.signed}, "
                f"targets={_few(self.target_names())}, input_size={tuple(self.input_size)}, "
                f"images={'none (a tensor was explained)' if self.images is None else len(self.images)}"
                + (f", options={self.options!r}" if self.options else "") + ")")

    def upsample(self, size: Union[None, int, tuple[int, int]] = None, mode: str = "bilinear") -> Tensor:
        """Maps resized to ``size`` (an int for a square; default: the model input size).

        Args:
            size: (H, W), an int, or None.
            mode: ``"bilinear"``, ``"bicubic"``, ``"nearest"``, ``"nearest-exact"`` or ``"area"``.

        Returns:
            (B, H, W) float32.

        Raises:
            UsageError: a size that is not positive integers, or an unknown mode.
        """
        return _upsample(self.maps, self.layout, self.input_size, size, mode)

    def target_names(self) -> list[str]:
        """Per image, the target's label name (or its index as text; a callable target's name, as
        ``"score norm"``: the -1 it is stored as read like a class)."""
        names = self.label_names or []
        return [names[t] if 0 <= t < len(names) else str(t) if t >= 0 else f"score {self.score_name or 'callable'}"
                for t in self.targets.tolist()]

    def overlay(self, index: int = 0, image: Any = None, **kwargs: Any) -> Any:
        """Overlay map ``index`` on its image (the region the model saw), uint8 RGB.

        Args:
            index: which image of the batch.
            image: (H, W, 3) uint8 RGB, a PIL image or a path, to draw on; default: the stored image (the region
                the model saw). The original image as explained (its size), of which the model saw a crop,
                gets the map on that crop (``e.boxes[index]``) and the pixels the model did not see drawn as
                the map's lowest value (zero for signed maps, left clear).
            **kwargs: passed to :func:`vitexplain.viz.overlay` (``normalize`` defaults to
                ``"signed"`` for signed methods).
        """
        from .viz.overlays import overlay

        index = _image_index(index, len(self))
        if image is None:
            if self.images is None:
                raise UsageError(
                    "this explanation was computed from a tensor, so it has no image to draw on; "
                    "pass image=(H, W, 3) uint8 RGB, or explain images/paths instead of a tensor"
                )
            image = self.images[index]
        image = drawable(image)
        kwargs.setdefault("normalize", "signed" if self.signed else "minmax")
        h, w = image.shape[:2]
        if crop_of(self.boxes, index, (h, w)) is not None:
            # the original image of a crop: stretched over all of it, the map would sit on pixels it is not about
            return overlay(image, pasted(self.upsample()[index], self.boxes[index], self.signed), **kwargs)
        covered = covered_pixels(self.layout, tuple(self.maps.shape[-2:]), self.input_size, (h, w))
        if covered is None:
            return overlay(image, self.maps[index], **kwargs)
        # the cells reach past the image: draw on the image padded to their pixels, then crop
        padded = np.pad(np.asarray(image), ((0, covered[0] - h), (0, covered[1] - w), (0, 0)), mode="edge")
        return overlay(padded, self.maps[index], **kwargs)[:h, :w]

    def _repr_html_(self) -> str:
        """Jupyter display: each image's overlay with a colour bar, its method and target."""
        from .viz.notebook import explanation_tiles, tiles_html

        more = len(self) - 12
        return tiles_html([explanation_tiles(self)], f"... and {more} more images" if more > 0 else "")

    def show(self, max_images: int = 8) -> Any:
        """Draw the overlays (at most ``max_images``) with matplotlib; returns the figure.

        Raises:
            UsageError: matplotlib is not installed (``pip install matplotlib``).
        """
        from .viz._util import whole
        from .viz.notebook import explanation_tiles, show_tiles

        return show_tiles([explanation_tiles(self, whole(max_images, "max_images"))])

    def save(self, directory: Union[str, Path]) -> Path:
        """Write ``maps.npy`` and ``manifest.json`` (method, options, targets, sizes, token layout, crop boxes, the
        extras' structure) to a folder, and ``extras.npz`` (the tensors of ``extras``) when there are any;
        :meth:`load` reads it back (all but the images and logits).

        Raises:
            UsageError: ``directory`` is not a path, is a file, or lies below a file.
        """
        manifest = {
            "method": self.method,
            "options": json_options(self.options),
            "signed": self.signed,
            "targets": self.targets.tolist(),
            "target_names": self.target_names(),
            "input_size": list(self.input_size),
            "grid": list(self.maps.shape[-2:]),
            "sources": json_sources(self.sources),
            "layout": layout_json(self.layout),
            "label_names": self.label_names,
            "score_name": self.score_name,
            "boxes": boxes_json(self.boxes),
        }
        manifest["extras"], arrays = extras_json(self.extras)  # (they were dropped: attnlrp's grid, IG's steps)
        return write_saved(directory, self.maps, manifest, arrays)

    @classmethod
    def load(cls, directory: Union[str, Path]) -> "Explanation":
        """The explanation :meth:`save` wrote to ``directory``: its maps ((B, h, w) float32, on the CPU), targets,
        method, options, layout, sizes, crop boxes, label names and extras (their tensors on the CPU, with their
        dtypes); no images (``overlay(i, image=...)`` draws on one given) and no logits (None).

        Raises:
            UsageError: ``directory`` is not a folder an explanation was saved to.
        """
        maps, m = read_saved(directory, 3)
        return cls(maps=maps, targets=torch.tensor(m["targets"], dtype=torch.long), method=m["method"],
                   options=dict(m.get("options") or {}), logits=None, signed=bool(m["signed"]),
                   input_size=tuple(m["input_size"]), layout=layout_from_json(m.get("layout")), images=None,
                   sources=m.get("sources"), label_names=m.get("label_names"), boxes=boxes_from_json(m.get("boxes")),
                   score_name=m.get("score_name"), extras=dict(m.get("extras") or {}))


@dataclass(repr=False)
class CaptionExplanation:
    """Per-word maps of a batch of captions.

    Attributes:
        maps: (B, T, gh, gw) float32; rows past an image's caption length are zero.
        tokens: per image, its words (generated or given), at most T.
        ids: (B, T) long token ids of the explained words.
        captions: per image, the caption string.
        method: method name.
        options: method options used.
        input_size: (H, W) of the model input.
        layout: token layout of the image encoder.
        images: (H, W, 3) uint8 RGB regions the model saw, when images were explained.
        sources: the inputs as given (paths or None), when images were explained.
        signed: whether maps are signed (``attnlrp``, ``cp_lrp``): :meth:`figure` then draws them with
            ``normalize="signed"`` on the diverging ``"bwr"`` map (zero neutral), as the CLI does.
        boxes: per image, its crop box in the original image (when images were explained).
    """

    maps: Tensor
    tokens: list[list[str]]
    ids: Tensor
    captions: list[str]
    method: str
    options: dict[str, Any]
    input_size: tuple[int, int]
    layout: Optional[TokenLayout] = None
    images: Optional[list[Any]] = None
    sources: Optional[list[Any]] = None
    signed: bool = False
    boxes: Optional[list[Any]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        batch = _batch_size(self.ids, "ids", self.method)
        _check_maps(self.maps, batch, 4, "(B, T, h, w)", self.method)
        if len(self.tokens) != batch or len(self.captions) != batch:
            raise CaptureError(
                f"{self.method}: {len(self.tokens)} token lists and {len(self.captions)} captions for a batch of "
                f"{batch} images; a caption explanation holds one of each per image"
            )

    def __len__(self) -> int:
        return int(self.maps.shape[0])

    def __repr__(self) -> str:
        """One line: method, map shape, captions (the dataclass's repr printed every map value)."""
        return (f"{type(self).__name__}(method={self.method!r}, maps={_shape(self.maps)}, signed={self.signed}, "
                f"captions={_few(self.captions)}, input_size={tuple(self.input_size)}"
                + (f", options={self.options!r}" if self.options else "") + ")")

    def upsample(self, size: Union[None, int, tuple[int, int]] = None, mode: str = "bilinear") -> Tensor:
        """Maps resized to ``size`` ((H, W) or an int; default: the model input size): (B, T, H, W).

        Args:
            size: (H, W), an int, or None.
            mode: as :meth:`Explanation.upsample` (``"bilinear"``, ``"nearest"``, ...).

        Raises:
            UsageError: a size that is not positive integers, or an unknown mode.
        """
        return _upsample(self.maps, self.layout, self.input_size, size, mode)

    def save(self, directory: Union[str, Path]) -> Path:
        """Write ``maps.npy`` ((B, T, h, w) float32) and ``manifest.json`` (method, options, captions, words,
        token ids, sizes) to a folder, as :meth:`Explanation.save` does.

        Raises:
            UsageError: ``directory`` is not a path, is a file, or lies below a file.
        """
        manifest = {
            "method": self.method,
            "options": json_options(self.options),
            "signed": self.signed,
            "captions": list(self.captions),
            "tokens": [list(t) for t in self.tokens],
            "ids": self.ids.tolist(),
            "input_size": list(self.input_size),
            "grid": list(self.maps.shape[-2:]),
            "sources": json_sources(self.sources),
            "layout": layout_json(self.layout),
            "boxes": boxes_json(self.boxes),
        }
        return write_saved(directory, self.maps, manifest)

    @classmethod
    def load(cls, directory: Union[str, Path]) -> "CaptionExplanation":
        """The caption explanation :meth:`save` wrote to ``directory`` (maps (B, T, h, w) float32 on the CPU,
        words, ids, captions, layout, sizes; no images). A vision-language model's loads as a
        :class:`CaptionExplanation`: its per-image maps at the original resolution are not saved.

        Raises:
            UsageError: ``directory`` is not a folder a caption explanation was saved to.
        """
        maps, m = read_saved(directory, 4)
        return CaptionExplanation(
            maps=maps, tokens=[list(t) for t in m["tokens"]], ids=torch.tensor(m["ids"], dtype=torch.long),
            captions=list(m["captions"]), method=m["method"], options=dict(m.get("options") or {}),
            input_size=tuple(m["input_size"]), layout=layout_from_json(m.get("layout")), images=None,
            sources=m.get("sources"), signed=bool(m.get("signed", False)), boxes=boxes_from_json(m.get("boxes")))

    def _repr_html_(self) -> str:
        """Jupyter display: per image its caption, then each word under its overlay."""
        from .viz.notebook import caption_tiles, tiles_html

        more = len(self) - 4
        return tiles_html(caption_tiles(self), f"... and {more} more images" if more > 0 else "")

    def show(self, max_images: int = 4) -> Any:
        """Draw each word's overlay (at most ``max_images`` images) with matplotlib; returns the figure.

        Raises:
            UsageError: matplotlib is not installed (``pip install matplotlib``).
        """
        from .viz._util import whole
        from .viz.notebook import caption_tiles, show_tiles

        return show_tiles(caption_tiles(self, whole(max_images, "max_images")))

    def figure(self, index: int = 0, image: Any = None, **kwargs: Any) -> Any:
        """One RGB figure: each word of caption ``index`` under its overlay (uint8 RGB).

        ``image`` (default: the region the model saw) may be the original image as explained (its size): each
        word's map is then placed on the crop the model saw, as :meth:`Explanation.overlay` does.

        ``**kwargs`` go to :func:`vitexplain.viz.caption_figure`; signed maps default to ``normalize="signed"``
        and ``colormap="bwr"`` (drawn min-max on ``"jet"``, a word's zero relevance looked like evidence).
        """
        from .viz.caption import caption_figure

        kwargs.setdefault("normalize", "signed" if self.signed else "minmax")
        kwargs.setdefault("colormap", "bwr" if kwargs["normalize"] == "signed" else "jet")
        index = _image_index(index, len(self))
        if image is None:
            if self.images is None:
                raise UsageError("pass image=(H, W, 3) uint8 RGB: this explanation was computed from a tensor")
            image = self.images[index]
        words = self.tokens[index]
        maps = self.maps[index, : len(words)]
        image = drawable(image)
        h, w = image.shape[:2]
        if crop_of(self.boxes, index, (h, w)) is not None:  # the original image: each word's map on the crop
            maps = pasted(self.upsample()[index, : len(words)], self.boxes[index], self.signed)
        elif covered_pixels(self.layout, tuple(self.maps.shape[-2:]), self.input_size, (h, w)) is not None:
            maps = self.upsample((h, w))[index, : len(words)]  # a padded grid: its cells on their own pixels
        return caption_figure(image, words, maps, **kwargs)


@dataclass(repr=False)
class VLMCaptionExplanation(CaptionExplanation):
    """Per-word maps of a vision-language model, per image at its original resolution.

    ``maps`` is (B, T, H, W) with (H, W) the largest original height and width of the batch: image
    b's map at its original resolution is ``image_maps[b]``; ``maps[b]`` is that map resampled
    (nearest) to (H, W) when the image is smaller, so that an overlay, which resizes a map onto its
    image, lines up.

    Attributes:
        prompts: per image, the prompt it was asked with.
        image_maps: per image, (T, H_b, W_b) float32 at the original resolution.
        token_scores: per image, (T, n_b) float32: the method's raw score of each image token the
            language model sees (in its order; also one without pixels, such as the class token
            LLaVA's "full" strategy keeps), before mapping to pixels.
        layers: per image, one (T, H_b, W_b) map per token grid (``"image"``, ``"thumbnail"``,
            ``"tile r,c"``), whose sum is ``image_maps[b]``.
    """

    prompts: list[str] = field(default_factory=list)
    image_maps: list[Tensor] = field(default_factory=list, repr=False)
    token_scores: list[Tensor] = field(default_factory=list, repr=False)
    layers: list[dict[str, Tensor]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        batch = len(self)
        if len(self.image_maps) != batch or len(self.token_scores) != batch:
            raise CaptureError(
                f"{self.method}: {len(self.image_maps)} image maps and {len(self.token_scores)} token scores for a "
                f"batch of {batch} images; a VLM explanation holds one of each per image"
            )


_MODES = ("bilinear", "bicubic", "nearest", "nearest-exact", "area")


def _shape(maps: Tensor) -> str:
    """``(2, 8, 8) float32`` (and the device when not the CPU)."""
    device = "" if maps.device.type == "cpu" else f" on {maps.device}"
    return f"({', '.join(str(d) for d in maps.shape)}) {str(maps.dtype).replace('torch.', '')}{device}"


def _few(items: list[Any], most: int = 4) -> str:
    """The first ``most`` items of a list, and how many more."""
    shown = ", ".join(repr(i) for i in items[:most])
    return f"[{shown}{f', ... {len(items) - most} more' if len(items) > most else ''}]"


def _upsample(maps: Tensor, layout: Optional[TokenLayout], input_size: tuple[int, int], size: Any, mode: str) -> Tensor:
    """:func:`~vitexplain.placement.upsampled` of a result's maps after checking ``size`` and ``mode``.

    Raises:
        UsageError: a size that is not positive integers, or an unknown mode.
    """
    size = _output_size(size, input_size)
    if mode not in _MODES:
        raise UsageError(f"upsample mode must be one of {list(_MODES)}, got {mode!r}")
    return upsampled(maps, layout, input_size, size, mode)


def _output_size(size: Any, default: tuple[int, int]) -> tuple[int, int]:
    """``(H, W)`` of an upsample: ``default`` for None, a square for an int.

    Raises:
        UsageError: not one or two positive integers.
    """
    if size is None:
        return (int(default[0]), int(default[1]))
    values = [size] if isinstance(size, Integral) else list(size) if isinstance(size, (tuple, list)) else None
    if values is None or len(values) not in (1, 2) or any(isinstance(v, bool) or not isinstance(v, Integral) or v < 1
                                                           for v in values):
        raise UsageError(f"size must be (H, W) or an int, in positive whole pixels; got {size!r}")
    return (int(values[0]), int(values[-1]))


def _batch_size(reference: Any, what: str, method: str) -> int:
    """B, the first dimension of ``reference`` (the targets or ids, one row per image)."""
    if not isinstance(reference, Tensor) or reference.dim() < 1:
        raise CaptureError(f"{method}: {what} must be a tensor with one row per image, got {type(reference).__name__}")
    return int(reference.shape[0])


def _check_maps(maps: Any, batch: int, dims: int, shape: str, method: str) -> None:
    """Raise unless ``maps`` is a ``dims``-D tensor with one map per image (first dim ``batch``).

    A method that reads a module whose output mixes the batch with tokens (e.g. TNT's inner
    blocks, ``(B * patches, n, C)``) would otherwise hand image 0 someone else's map.
    """
    if not isinstance(maps, Tensor) or maps.dim() != dims or int(maps.shape[0]) != batch:
        got = tuple(maps.shape) if isinstance(maps, Tensor) else type(maps).__name__
        raise CaptureError(
            f"method {method!r} produced maps of shape {got} for a batch of {batch} images; maps must be "
            f"{shape} with one map per image, so e.maps[i] would not be image i's map. The layer it read "
            "does not hold one feature map per image (e.g. it mixes the batch with tokens): choose another "
            "layer or method"
        )
