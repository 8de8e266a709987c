"""Ground truth for the hierarchical family (issue 23, item 4): the bundled ``shapes-hier`` (a timm
PVTv2 trained on the shapes data) explained by ``generic`` points at the targeted object.

Images hold two objects of different classes; each class is targeted in turn and the peak of the
map must fall on that object (class-discriminative pointing, ``vx.metrics.pointing_game``).
Fresh seeds that training never saw (training uses seeds < 9,000).
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx

N_IMAGES = 100
SEED = 21_000  # the model was chosen on seed 20,000 (benchmarks/hier_pointing.py); the floor is measured here


@pytest.fixture(scope="module")
def setup():
    model = vx.zoo.load("shapes-hier")
    batch = vx.data.shapes(N_IMAGES, seed=SEED, num_objects=2, distinct_classes=True)
    targets = tuple(torch.stack([c[k] for c in batch.classes]) for k in (0, 1))
    masks = tuple(torch.stack([m[k] for m in batch.masks]) for k in (0, 1))
    return model, batch.tensor, targets, masks


# Floor: measured on these 100 images (seed 21,000), n = 200 (image, target) pairs, minus three
# binomial standard errors sqrt(p (1 - p) / n), rounded down to 2 decimals: measured 0.885,
# SE 0.023 -> 0.81 (benchmarks/hier_pointing.py --seed 21000; 0.890 on seed 20,000).
GENERIC_FLOOR = 0.81


def test_generic_points_at_the_targeted_object(setup) -> None:
    model, x, targets, masks = setup
    ex = vx.Explainer(model)
    hits = []
    for target, mask in zip(targets, masks):
        e = ex.explain(x, method="generic", target=target)
        assert e.maps.shape[0] == x.shape[0]
        hits.append(vx.metrics.pointing_game(e.maps, mask))
    accuracy = torch.cat(hits).float().mean().item()
    print(f"shapes-hier generic: class-discriminative pointing {accuracy:.3f} over {2 * x.shape[0]}")
    assert accuracy >= GENERIC_FLOOR
