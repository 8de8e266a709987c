"""The synthetic shapes' randomness: counter-based uniforms per image and two fixed texture / noise banks.

Image ``i`` of ``shapes(n, seed)`` reads its own stream, SplitMix64 of ``(seed, i, j)`` (Steele, Lea and Flood,
"Fast splittable pseudorandom number generators", OOPSLA 2014), vectorised over images: so an image does not
depend on ``n``, on the other images, or on NumPy's global random state.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["uniforms", "banks", "Stream"]

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic)."""
    z = z ^ (z >> _U64(30))
    z = z * _U64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> _U64(27))
    z = z * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def uniforms(seed: int, indices: np.ndarray, count: int) -> np.ndarray:
    """Counter-based uniforms in [0, 1): row ``r`` depends only on ``(seed, indices[r])``.

    Args:
        seed: stream seed (any Python int; taken modulo 2**64).
        indices: (n,) image indices within the stream.
        count: uniforms per image.

    Returns:
        (n, count) float64 array.
    """
    with np.errstate(over="ignore"):
        s = mix64(np.array([seed % (1 << 64)], dtype=_U64) + _GOLDEN)
        key = mix64(s ^ mix64(indices.astype(_U64) * _GOLDEN + _U64(0x632BE59BD9B4E019)))
        z = key[:, None] + np.arange(1, count + 1, dtype=_U64)[None, :] * _GOLDEN
        z = mix64(z)
    return (z >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


@functools.lru_cache(maxsize=4)
def banks(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Fixed texture and noise banks, (B, B, 3) float32 each with B >= size + 64.

    The texture bank is smooth (features of ~12 px), mostly luminance with a little chroma, unit
    scale; the noise bank is i.i.d. standard normal. Images take random crops of both.
    """
    import cv2

    side = max(576, size + 64)
    cells = side // 12 + 2
    rng = np.random.default_rng(20240611)
    lum = rng.standard_normal((cells, cells, 1), dtype=np.float32)
    chroma = 0.25 * rng.standard_normal((cells, cells, 3), dtype=np.float32)
    tex = cv2.resize(lum + chroma, (cells * 12, cells * 12), interpolation=cv2.INTER_CUBIC)
    tex = np.ascontiguousarray(tex[:side, :side])
    noise = rng.standard_normal((side, side, 3), dtype=np.float32)
    return tex, noise


class Stream:
    """Sequential reader over one image's uniforms."""

    __slots__ = ("u", "pos")

    def __init__(self, u: list[float]) -> None:
        self.u = u
        self.pos = 0

    def next(self) -> float:
        v = self.u[self.pos]
        self.pos += 1
        return v

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * self.next()

    def integer(self, lo: int, hi: int) -> int:
        """Uniform int in ``[lo, hi)``."""
        return lo + min(int(self.next() * (hi - lo)), hi - lo - 1)

    def sign(self) -> float:
        return 1.0 if self.next() < 0.5 else -1.0
