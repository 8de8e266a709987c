"""Do the maps point at what the model used? Measured on the bundled shapes-vit.

Images hold two objects of different classes; each class is targeted in turn and the pointing
game is played against that object's mask (class-discriminative) or against both (class-agnostic
methods). Fresh seeds (>= 10,000) that training never saw.
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx

N_IMAGES = 100


@pytest.fixture(scope="module")
def setup():
    model = vx.zoo.load("shapes-vit")
    batch = vx.data.shapes(N_IMAGES, seed=20_000, num_objects=2, distinct_classes=True)
    x = batch.tensor
    # both objects of every image, each as its own target
    first = torch.stack([c[0] for c in batch.classes])
    second = torch.stack([c[1] for c in batch.classes])
    mask_first = torch.stack([m[0] for m in batch.masks])
    mask_second = torch.stack([m[1] for m in batch.masks])
    union = mask_first | mask_second
    return model, x, (first, second), (mask_first, mask_second), union


@pytest.fixture(scope="module")
def maps(setup):
    model, x, (first, second), _, _ = setup
    ex = vx.Explainer(model)
    names = ["cdam", "generic", "gradcam", "rollout", "raw", "attn_gradcam", "grad_rollout", "legrad"]
    out = {}
    for target in (first, second):
        for e in ex.explain(x, method=names, target=target):
            out.setdefault(e.method, []).append(e.maps)
    return out


@pytest.mark.parametrize("method", ["cdam", "generic", "gradcam"])
def test_class_discriminative_pointing(setup, maps, method):
    _, _, _, (mask_first, mask_second), _ = setup
    hits = torch.cat(
        [
            vx.metrics.pointing_game(maps[method][0], mask_first),
            vx.metrics.pointing_game(maps[method][1], mask_second),
        ]
    )
    accuracy = hits.float().mean().item()
    assert accuracy >= 0.90, f"{method}: class-discriminative pointing {accuracy:.3f}"


@pytest.mark.parametrize("method", ["rollout", "raw"])
def test_class_agnostic_maps_land_on_some_object(setup, maps, method):
    _, _, _, _, union = setup
    accuracy = vx.metrics.pointing_game(maps[method][0], union).float().mean().item()
    assert accuracy >= 0.90, f"{method}: pointing on any object {accuracy:.3f}"


def test_class_sensitivity_of_cdam_and_generic_below_rollout(maps):
    sensitivity = {
        m: vx.metrics.class_sensitivity(maps[m][0], maps[m][1]).mean().item() for m in ("cdam", "generic", "rollout")
    }
    assert sensitivity["rollout"] > 0.99  # rollout ignores the class
    for m in ("cdam", "generic"):
        assert sensitivity[m] < sensitivity["rollout"] - 0.3, sensitivity


@pytest.mark.parametrize("method", ["generic", "cdam", "gradcam"])
def test_randomising_all_blocks_destroys_the_maps(setup, method):
    model, x, (first, _), _, _ = setup
    blocks = [f"blocks.{i}" for i in reversed(range(len(model.blocks)))]
    layers = ["head", "norm", *blocks]
    result = vx.metrics.randomization_check(
        model,
        lambda m: vx.Explainer(m).explain(x[:24], method=method, target=first[:24]).maps,
        layers=layers,
    )
    final = result.correlations[-1].mean().item()
    assert final < 0.3, f"{method}: rank correlation after randomising every block {final:.3f}"
