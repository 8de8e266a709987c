"""Per-image randomness for the metrics that sample: each image's draws come from its own content.

ROAD's imputation noise and tie order, max/avg-sensitivity's and smooth MPRT's input noise are drawn
from one generator per image, seeded by a hash of the image's values and the metric's ``seed``: an
image gets the same draws wherever it stands in a batch and whatever else is in the batch, so a batch
scores as its images one by one and a data set scores the same in chunks of any size (identical images
get identical draws). The hash (BLAKE2b of the image's bytes) is the same in every process.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

__all__ = ["image_seeds", "image_generators", "per_image_draws"]

_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF


def image_seeds(images: Tensor, seed: int, *keys: int) -> list[int]:
    """One seed per image from its values, ``seed`` and ``keys``.

    Args:
        images: ``(B, ...)`` tensor (any dtype, any device).
        seed: the metric's seed.
        keys: further ints (e.g. which draw: noise or tie order).

    Returns:
        ``B`` ints in ``[0, 2**63)``.
    """
    salt = repr((int(seed),) + tuple(int(k) for k in keys)).encode()
    raw = images.detach().contiguous().reshape(len(images), -1).view(torch.uint8).cpu().numpy()
    return [int.from_bytes(hashlib.blake2b(row.tobytes() + salt, digest_size=8).digest(), "little") & _SEED_MASK
            for row in raw]


def image_generators(images: Tensor, seed: int, *keys: int) -> list[torch.Generator]:
    """One generator per image, on the images' device, seeded by :func:`image_seeds`."""
    return [torch.Generator(device=images.device).manual_seed(s) for s in image_seeds(images, seed, *keys)]


def per_image_draws(generators: list[torch.Generator], shape: torch.Size, draw: str, like: Tensor) -> Tensor:
    """``(B, *shape)``: image ``b``'s next ``torch.rand`` (``draw="rand"``) or ``torch.randn`` draw from
    ``generators[b]``."""
    fn = torch.rand if draw == "rand" else torch.randn
    return torch.stack([fn(shape, generator=g, device=like.device, dtype=like.dtype) for g in generators])
