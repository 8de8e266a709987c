"""How one image of the synthetic shapes benchmark is drawn: its shape classes and colors, their outlines,
where the objects go and the cv2 rendering of objects, background texture, clutter and noise.

:func:`vitexplain.data.synthetic.shapes` draws each image of a batch with :func:`draw_one`, from that image's own
random draws (see the determinism note there).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .streams import Stream, banks

__all__ = ["SHAPES", "COLORS", "COLOR_RGB", "MAX_TRIES", "UNIFORMS_PER_IMAGE", "draw_one"]

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

#: Placement attempts per object and scale (:func:`draw_one` takes ``2 * MAX_TRIES`` draws per object).
MAX_TRIES = 40
#: Uniform draws of one image besides placement: enough for the worst case (about 140 draws).
UNIFORMS_PER_IMAGE = 160


def _place(st: Stream, tries: list[float], radii: list[float], size: int) -> list[tuple[float, float]] | None:
    """Centres with disjoint circumcircles and distinct x, or None on failure."""
    gap = 0.05 * size
    min_dx = 0.09 * size
    centres: list[tuple[float, float]] = []
    t = 0
    for r in radii:
        lo, span = r + 1.0, size - 2.0 - 2.0 * r
        for _ in range(MAX_TRIES):
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


def draw_one(
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
