"""Synthetic shapes benchmark: images with ground-truth masks, labels and captions.

Each image holds one to three non-overlapping objects. An object has a shape class
(:data:`SHAPES`), a color (:data:`COLORS`), a random size, position and a small rotation.
Objects lie on a noisy, textured background with clutter (thin lines, small blobs and
low-contrast patches, all desaturated so that none of them can be mistaken for an object).

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

import math
from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np
import torch
from ..errors import OutOfRangeError, UsageError
from .streams import Stream, banks, uniforms

__all__ = [
    "SHAPES",
    "COLORS",
    "COLOR_RGB",
    "MEAN",
    "STD",
    "ShapesBatch",
    "shapes",
    "normalize",
    "denormalize",
]

#: Shape class names; the label index of a shape is its position here.
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
#: Color names; the color index of an object is its position here.
COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow")
#: Nominal RGB value of each color (each object gets a random jitter around it).
COLOR_RGB: tuple[tuple[int, int, int], ...] = (
    (215, 40, 40),
    (40, 185, 60),
    (45, 85, 230),
    (230, 210, 45),
)
#: Per-channel mean of the generator's images in [0, 1] (RGB); normalisation of the zoo models.
MEAN: tuple[float, float, float] = (0.413, 0.413, 0.398)
#: Per-channel standard deviation in [0, 1] (RGB); normalisation of the zoo models.
STD: tuple[float, float, float] = (0.166, 0.150, 0.153)

IndexLike = Union[int, slice, Sequence[int], np.ndarray, torch.Tensor]

# Shape outlines as polygons of unit circumradius, centred at the origin, (P, 2) float (x, y).
_CIRCLE_POINTS = 48


def _templates() -> list[np.ndarray]:
    def ring(radii: Sequence[float], start_deg: float) -> np.ndarray:
        count = len(radii)
        ang = np.deg2rad(start_deg) + np.arange(count) * (2 * math.pi / count)
        radii = np.asarray(radii, dtype=np.float64)
        return np.stack([radii * np.cos(ang), radii * np.sin(ang)], axis=1)

    circle = ring([0.9] * _CIRCLE_POINTS, 0.0)
    square = ring([0.95] * 4, 45.0)
    triangle = ring([1.0] * 3, -90.0)
    star = ring([1.0, 0.45] * 5, -90.0)
    a, w = 0.95, 0.32  # half arm length, half arm width
    cross = np.array(
        [(w, -a), (w, -w), (a, -w), (a, w), (w, w), (w, a),
         (-w, a), (-w, w), (-a, w), (-a, -w), (-w, -w), (-w, -a)],
        dtype=np.float64,
    )
    return [circle, square, triangle, star, cross]


_TEMPLATES = _templates()
_SHIFT = 4  # cv2 fixed-point bits for sub-pixel polygon vertices


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


_MAX_TRIES = 40  # placement attempts per object and scale
_UNIFORMS_PER_IMAGE = 160  # enough for the worst case (about 140 draws)


def _place(st: Stream, tries: list[float], radii: list[float], size: int) -> list[tuple[float, float]] | None:
    """Centres with disjoint circumcircles and distinct x, or None on failure."""
    gap = 0.05 * size
    min_dx = 0.09 * size
    centres: list[tuple[float, float]] = []
    t = 0
    for r in radii:
        lo, span = r + 1.0, size - 2.0 - 2.0 * r
        for _ in range(_MAX_TRIES):
            cx, cy = lo + span * tries[t], lo + span * tries[t + 1]
            t += 2
            ok = True
            for (px, py), pr in zip(centres, radii):
                if abs(cx - px) < min_dx or math.hypot(cx - px, cy - py) < r + pr + gap:
                    ok = False
                    break
            if ok:
                centres.append((cx, cy))
                break
        else:
            return None
    return centres


def _draw_one(
    u: np.ndarray,
    tries: np.ndarray,
    size: int,
    count_range: tuple[int, int],
    distinct_classes: bool,
    distinct_colors: bool,
    clutter: bool,
    out: np.ndarray,
) -> tuple[np.ndarray, list[int], list[int]]:
    """Draw one image into ``out`` ((H, W, 3) uint8).

    Returns:
        (k, H, W) bool masks, classes and colors of the objects, sorted left to right.
    """
    import cv2

    st = Stream(u.tolist())
    tex_bank, noise_bank = banks(size)
    side = tex_bank.shape[0]

    # Objects: count, classes, colors, radii, angles, color jitter.
    lo, hi = count_range
    k = st.integer(lo, hi + 1)
    n_s, n_c = len(SHAPES), len(COLORS)
    if distinct_classes:
        keys = [st.next() for _ in range(n_s)]
        classes = sorted(range(n_s), key=keys.__getitem__)[:k]
    else:
        classes = [st.integer(0, n_s) for _ in range(k)]
    if distinct_colors:
        keys = [st.next() for _ in range(n_c)]
        colors = sorted(range(n_c), key=keys.__getitem__)[:k]
    else:
        colors = [st.integer(0, n_c) for _ in range(k)]
    radii = [st.uniform(0.11, 0.2) * size for _ in range(k)]
    angles = [math.radians(st.uniform(-30.0, 30.0)) for _ in range(k)]
    rgb = [
        tuple(float(min(255.0, max(0.0, COLOR_RGB[c][ch] + st.uniform(-25.0, 25.0)))) for ch in range(3))
        for c in colors
    ]
    tries_list = tries.tolist()
    scale = 1.0
    centres = _place(st, tries_list, radii, size)
    while centres is None:  # rare: shrink and retry with the same draws (still deterministic)
        scale *= 0.85
        radii = [max(r * 0.85, 0.07 * size) for r in radii]
        centres = _place(st, tries_list, radii, size)
        if scale < 0.3:  # cannot happen for size >= 16 and k <= 3; keep the loop finite anyway
            centres = [((j + 0.5) * size / k, size / 2.0) for j in range(k)]
            radii = [min(r, 0.4 * size / k) for r in radii]

    # Background: flat tinted gray + a crop of the smooth texture bank.
    gray = st.uniform(55.0, 150.0)
    tint = [st.uniform(-10.0, 10.0) for _ in range(3)]
    amp = st.uniform(6.0, 18.0)
    ty, tx = st.integer(0, side - size + 1), st.integer(0, side - size + 1)
    img = cv2.add(tex_bank[ty:ty + size, tx:tx + size] * amp, tuple(gray + t for t in tint))

    if clutter:
        n_patch, n_line, n_blob = st.integer(0, 3), st.integer(1, 5), st.integer(2, 7)
        if n_patch:
            off = np.zeros((size, size, 3), dtype=np.float32)
            for _ in range(n_patch):
                centre = (st.integer(0, size), st.integer(0, size))
                axes = (int(st.uniform(0.08, 0.2) * size), int(st.uniform(0.08, 0.2) * size))
                shift = st.sign() * st.uniform(7.0, 14.0)
                cv2.ellipse(off, centre, axes, st.uniform(0.0, 180.0), 0, 360,
                            (shift, shift, shift), -1, cv2.LINE_AA)
            img = cv2.add(img, off)
        for _ in range(n_line):
            p1 = (st.integer(0, size), st.integer(0, size))
            p2 = (st.integer(0, size), st.integer(0, size))
            level = gray + st.sign() * st.uniform(25.0, 55.0)
            col = tuple(level + st.uniform(-6.0, 6.0) for _ in range(3))
            cv2.line(img, p1, p2, col, 1, cv2.LINE_AA)
        for _ in range(n_blob):
            centre = (st.integer(0, size), st.integer(0, size))
            rad = max(1, int(round(st.uniform(0.015, 0.035) * size)))
            level = gray + st.sign() * st.uniform(25.0, 60.0)
            col = tuple(level + st.uniform(-6.0, 6.0) for _ in range(3))
            cv2.circle(img, centre, rad, col, -1, cv2.LINE_AA)

    # Objects, left to right (the centroid of every template is its centre).
    order = sorted(range(k), key=lambda j: centres[j][0])
    masks = np.zeros((k, size, size), dtype=np.uint8)
    fixed = float(1 << _SHIFT)
    for slot, j in enumerate(order):
        c, s = math.cos(angles[j]), math.sin(angles[j])
        rot = np.array([[c, s], [-s, c]]) * radii[j]
        pts = _TEMPLATES[classes[j]] @ rot + np.asarray(centres[j])
        pts = np.round((pts - 0.5) * fixed).astype(np.int32)
        cv2.fillPoly(masks[slot], [pts], 1, cv2.LINE_8, _SHIFT)
        cv2.fillPoly(img, [pts], rgb[j], cv2.LINE_8, _SHIFT)

    # Pixel noise from a crop of the noise bank.
    sigma = st.uniform(3.0, 8.0)
    ny, nx = st.integer(0, side - size + 1), st.integer(0, side - size + 1)
    # img + sigma * noise, rounded and saturated to uint8, written into ``out``.
    cv2.addWeighted(img, 1.0, noise_bank[ny:ny + size, nx:nx + size], sigma, 0.0, dst=out, dtype=cv2.CV_8U)
    return masks.view(bool), [classes[j] for j in order], [colors[j] for j in order]


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
        u_all = uniforms(seed, idx, _UNIFORMS_PER_IMAGE + 3 * 2 * _MAX_TRIES)
        for r in range(len(idx)):
            i = c0 + r
            m, cls, col = _draw_one(
                u_all[r, :_UNIFORMS_PER_IMAGE], u_all[r, _UNIFORMS_PER_IMAGE:], size, count_range,
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

