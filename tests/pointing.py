"""Class-discriminative pointing of a method's pixel maps on two-object shapes images (test helper)."""

from __future__ import annotations

from typing import Optional

import torch

import vitexplain as vx


def pixel_pointing(model: torch.nn.Module, images: int, seed: int, method: str, tolerance: Optional[int] = None) -> float:
    """Fraction of targets whose map peaks inside the targeted object: each image's two classes targeted in turn
    (``images`` two-object images of ``seed``), maps at pixel resolution (nothing upsampled)."""
    batch = vx.data.shapes(images, seed=seed, num_objects=2, distinct_classes=True)
    ex = vx.Explainer(model)
    hits = []
    for k in (0, 1):
        target = torch.stack([c[k] for c in batch.classes])
        masks = torch.stack([m[k] for m in batch.masks])
        maps = ex.explain(batch.tensor, method=method, target=target).maps
        assert maps.shape[-2:] == masks.shape[-2:]  # pixel resolution
        kwargs = {} if tolerance is None else {"tolerance": tolerance}
        hits.append(vx.metrics.pointing_game(maps, masks, **kwargs))
    return torch.cat(hits).float().mean().item()
