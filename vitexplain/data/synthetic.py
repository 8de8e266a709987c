"""Synthetic shapes benchmark: images with ground-truth masks, labels and captions.

Each image holds one to three non-overlapping objects. An object has a shape class
(:data:`SHAPES`), a color (:data:`COLORS`), a random size, position and a small rotation.
Objects lie on a noisy, textured background with clutter (thin lines, small blobs and
low-contrast patches, all desaturated so that none of them can be mistaken for an object).
How one image is drawn: :mod:`vitexplain.data.drawing`; here, the batch and its ground truth.

Determinism: image ``i`` of ``shapes(n, seed)`` is drawn from its own counter-based random
stream (SplitMix64 of ``(seed, i, j)``, vectorised over images), plus crops of two fixed
texture/noise banks; so it is the same whatever ``n`` is (``shapes(10, 3)[4]`` equals
``shapes(5, 3)[4]``), as long as the other options are equal, and it does not depend on NumPy's
global random state.

Seed convention used by the bundled zoo: training uses seeds ``< 10_000``
(see :mod:`vitexplain.zoo.train`); evaluation and tests use seeds ``>= 10_000``.

Example::

    batch = vx.data.shapes(n=64, seed=10_000)
    batch.images      # (64, 64, 64, 3) uint8 RGB
    batch.tensor      # (64, 3, 64, 64) float32, normalised with MEAN / STD
    batch.captions[0] # e.g. "red circle and blue star"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np
import torch
from ..errors import OutOfRangeError, UsageError
from .drawing import COLORS, MAX_TRIES, SHAPES, UNIFORMS_PER_IMAGE, draw_one
from .streams import uniforms

__all__ = [
    "MEAN",
    "STD",
    "ShapesBatch",
    "shapes",
    "normalize",
    "denormalize",
]

#: Per-channel mean of the generator's images in [0, 1] (RGB); normalisation of the zoo models.
MEAN: tuple[float, float, float] = (0.413, 0.413, 0.398)
#: Per-channel standard deviation in [0, 1] (RGB); normalisation of the zoo models.
STD: tuple[float, float, float] = (0.166, 0.150, 0.153)

IndexLike = Union[int, slice, Sequence[int], np.ndarray, torch.Tensor]


@dataclass
class ShapesBatch:
    """A batch of synthetic shapes images with their ground truth.

    Objects of each image are sorted from left to right (by mask centroid x).

    Attributes:
        images: (n, H, W, 3) uint8 RGB images.
        labels: (n, C) float32 multi-hot labels over :data:`SHAPES`.
        masks: per image, a (k_i, H, W) bool tensor, one mask per object (disjoint).
        classes: per image, a (k_i,) long tensor of shape-class indices into :data:`SHAPES`.
        colors: per image, a (k_i,) long tensor of color indices into :data:`COLORS`.
        captions: per image, "<color> <shape>" of each object joined by " and ".
        word_objects: per image, for each caption word (``caption.split(" ")``) the index of
            the object it names, or -1 for "and".
        seed: the seed the batch was generated with.
        indices: (n,) the image index within the seed's stream of each image.
        tensor: (n, 3, H, W) float32 images normalised with :data:`MEAN` / :data:`STD`
            (computed on first access).
    """

    images: np.ndarray
    labels: torch.Tensor
    masks: list[torch.Tensor]
    classes: list[torch.Tensor]
    colors: list[torch.Tensor]
    captions: list[str]
    word_objects: list[list[int]]
    seed: int = 0
    indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _tensor: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def size(self) -> tuple[int, int]:
        """(H, W) of the images."""
        return int(self.images.shape[1]), int(self.images.shape[2])

    @property
    def tensor(self) -> torch.Tensor:
        """(n, 3, H, W) float32 normalised images (cached)."""
        if self._tensor is None:
            self._tensor = normalize(self.images)
        return self._tensor

    @property
    def num_objects(self) -> torch.Tensor:
        """(n,) long: the number of objects in each image."""
        return torch.tensor([len(c) for c in self.classes], dtype=torch.long)

    def subset(self, idx: IndexLike) -> "ShapesBatch":
        """The images at ``idx`` (int, slice, sequence, bool or index array) as a new batch."""
        if isinstance(idx, torch.Tensor):
            idx = idx.cpu().numpy()
        if isinstance(idx, (int, np.integer)):
            i = int(idx)
            if i < 0:
                i += len(self)
            if not 0 <= i < len(self):
                raise OutOfRangeError(f"index {idx} out of range for a batch of {len(self)}; use 0..{len(self) - 1} "
                                      "(or negative indices from the end)")
            sel = np.array([i])
        elif isinstance(idx, slice):
            sel = np.arange(len(self))[idx]
        else:
            arr = np.asarray(idx)
            sel = np.nonzero(arr)[0] if arr.dtype == bool else arr.astype(np.int64).reshape(-1)
        sel_list = [int(i) for i in sel]
        out = ShapesBatch(
            images=self.images[sel],
            labels=self.labels[torch.as_tensor(sel, dtype=torch.long)],
            masks=[self.masks[i] for i in sel_list],
            classes=[self.classes[i] for i in sel_list],
            colors=[self.colors[i] for i in sel_list],
            captions=[self.captions[i] for i in sel_list],
            word_objects=[list(self.word_objects[i]) for i in sel_list],
            seed=self.seed,
            indices=self.indices[sel] if len(self.indices) == len(self) else self.indices,
        )
        if self._tensor is not None:
            out._tensor = self._tensor[torch.as_tensor(sel, dtype=torch.long)]
        return out

    def __getitem__(self, idx: IndexLike) -> "ShapesBatch":
        """Same as :meth:`subset`; an int gives a batch of one image (ready for a model)."""
        return self.subset(idx)


def normalize(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Turn uint8 RGB images into the zoo models' input.

    Args:
        images: (n, H, W, 3) or (H, W, 3) uint8 RGB (numpy or torch).

    Returns:
        (n, 3, H, W) float32 tensor, ``(x / 255 - MEAN) / STD``.
    """
    x = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
    if x.ndim == 3:
        x = x.unsqueeze(0)
    if x.ndim != 4 or x.shape[-1] != 3:
        raise UsageError(f"expected (n, H, W, 3) RGB images, got shape {tuple(x.shape)}")
    x = x.permute(0, 3, 1, 2).to(torch.float32).div_(255.0)
    mean = torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1)
    return x.sub_(mean).div_(std).contiguous()


def denormalize(x: torch.Tensor) -> np.ndarray:
    """Inverse of :func:`normalize`.

    Args:
        x: (n, 3, H, W) or (3, H, W) normalised float tensor.

    Returns:
        (n, H, W, 3) or (H, W, 3) uint8 RGB numpy array.
    """
    squeeze = x.ndim == 3
    if squeeze:
        x = x.unsqueeze(0)
    mean = torch.tensor(MEAN, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    img = ((x.detach() * std + mean) * 255.0).round().clamp(0, 255).to(torch.uint8)
    out = img.permute(0, 2, 3, 1).cpu().numpy()
    return out[0] if squeeze else out


def _object_count_range(num_objects: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(num_objects, (int, np.integer)):
        lo = hi = int(num_objects)
    else:
        lo, hi = (int(v) for v in num_objects)
    if not 1 <= lo <= hi <= 3:
        raise UsageError(f"num_objects must be in 1..3 (an int or a (min, max) pair), got {num_objects}")
    return lo, hi


def shapes(
    n: int,
    seed: int = 0,
    *,
    size: int = 64,
    num_objects: int | tuple[int, int] = (1, 3),
    distinct_classes: bool = False,
    distinct_colors: bool = False,
    clutter: bool = True,
    start: int = 0,
) -> ShapesBatch:
    """Generate ``n`` synthetic shapes images with ground truth.

    Args:
        n: number of images.
        seed: seed of the stream (>= 0); image ``i`` depends only on ``(seed, i)`` and the options.
        size: image side in pixels (square images, ``size x size``).
        num_objects: exact number of objects (int) or an inclusive ``(min, max)`` range, in 1..3.
        distinct_classes: if True, the objects of an image have different shape classes.
        distinct_colors: if True, the objects of an image have different colors.
        clutter: if False, no lines, blobs or patches (texture and noise remain).
        start: index of the first image in the stream (images ``start .. start + n - 1``).

    Returns:
        A :class:`ShapesBatch` of ``n`` images with objects sorted left to right.
    """
    if n < 0:
        raise UsageError(f"n must be >= 0, got {n}")
    if seed < 0 or start < 0:
        raise UsageError(f"seed and start must be >= 0, got seed={seed}, start={start}")
    if size < 16:
        raise UsageError(f"size must be >= 16, got {size}")
    count_range = _object_count_range(num_objects)
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    masks: list[torch.Tensor] = []
    classes: list[torch.Tensor] = []
    colors: list[torch.Tensor] = []
    captions: list[str] = []
    word_objects: list[list[int]] = []
    labels = np.zeros((n, len(SHAPES)), dtype=np.float32)

    def _append(i: int, m: np.ndarray, cls: list[int], col: list[int]) -> None:
        masks.append(torch.from_numpy(m))
        classes.append(torch.tensor(cls, dtype=torch.long))
        colors.append(torch.tensor(col, dtype=torch.long))
        labels[i, cls] = 1.0
        words: list[str] = []
        objs: list[int] = []
        for j, (s, c) in enumerate(zip(cls, col)):
            if j:
                words.append("and")
                objs.append(-1)
            words += [COLORS[int(c)], SHAPES[int(s)]]
            objs += [j, j]
        captions.append(" ".join(words))
        word_objects.append(objs)
    indices = np.arange(start, start + n, dtype=np.int64)
    chunk = 1024
    for c0 in range(0, n, chunk):
        idx = indices[c0:c0 + chunk]
        u_all = uniforms(seed, idx, UNIFORMS_PER_IMAGE + 3 * 2 * MAX_TRIES)
        for r in range(len(idx)):
            i = c0 + r
            m, cls, col = draw_one(
                u_all[r, :UNIFORMS_PER_IMAGE], u_all[r, UNIFORMS_PER_IMAGE:], size, count_range,
                distinct_classes, distinct_colors, clutter, images[i],
            )
            _append(i, m, cls, col)
    return ShapesBatch(
        images=images,
        labels=torch.from_numpy(labels),
        masks=masks,
        classes=classes,
        colors=colors,
        captions=captions,
        word_objects=word_objects,
        seed=int(seed),
        indices=indices,
    )

