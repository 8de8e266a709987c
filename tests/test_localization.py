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
    names = ["cdam", "generic", "gradcam", "rollout", "raw"]
    out = {}
    for target in (first, second):
        for e in ex.explain(x, method=names, target=target):
            out.setdefault(e.method, []).append(e.maps)
    return out


# Floors: measured on these 100 images (seed 20,000), minus three binomial standard errors
# sqrt(p (1 - p) / n), rounded down to 2 decimals; where every image was a hit (p = 1) the error is
# that of one miss, p = 1 - 1/n. n counts (image, target) pairs.
@pytest.mark.parametrize(
    "method, floor",
    [
        ("cdam", 0.86),  # measured 0.920, n = 200
        ("generic", 0.96),  # measured 0.990, n = 200
        ("gradcam", 0.92),  # measured 0.965, n = 200
    ],
)
def test_class_discriminative_maps_point_at_the_targeted_object(setup, maps, method, floor):
    _, _, _, (mask_first, mask_second), _ = setup
    hits = torch.cat(
        [
            vx.metrics.pointing_game(maps[method][0], mask_first),
            vx.metrics.pointing_game(maps[method][1], mask_second),
        ]
    )
    accuracy = hits.float().mean().item()
    print(f"{method}: class-discriminative pointing {accuracy:.3f} over {len(hits)}")
    assert accuracy >= floor, f"{method}: class-discriminative pointing {accuracy:.3f} < {floor}"


@pytest.mark.parametrize(
    "method, floor",
    [
        ("rollout", 0.97),  # measured 1.000, n = 100 (the error of one miss)
        ("raw", 0.96),  # measured 0.990, n = 100
    ],
)
def test_class_agnostic_maps_land_on_some_object(setup, maps, method, floor):
    _, _, _, _, union = setup
    hits = vx.metrics.pointing_game(maps[method][0], union)
    accuracy = hits.float().mean().item()
    print(f"{method}: pointing on any object {accuracy:.3f} over {len(hits)}")
    assert accuracy >= floor, f"{method}: pointing on any object {accuracy:.3f} < {floor}"


# Ceilings: the mean correlation over the images, plus three standard errors (sd / sqrt(n)) of
# that mean, rounded up to 2 decimals (measured on the same images).
@pytest.mark.parametrize(
    "method, ceiling",
    [
        ("cdam", -0.68),  # measured mean -0.759, sd 0.255, n = 100
        ("generic", 0.01),  # measured mean -0.012, sd 0.051, n = 100
    ],
)
def test_class_sensitive_methods_give_different_maps_for_the_two_classes(maps, method, ceiling):
    # rollout does not depend on the target at all: the same map for both classes (correlation 1)
    torch.testing.assert_close(maps["rollout"][0], maps["rollout"][1], rtol=0, atol=0)
    assert vx.metrics.class_sensitivity(maps["rollout"][0], maps["rollout"][1]).min().item() == pytest.approx(1.0)
    sensitivity = vx.metrics.class_sensitivity(maps[method][0], maps[method][1])
    print(f"{method}: class sensitivity {sensitivity.mean():.3f} (sd {sensitivity.std():.3f}, n {len(sensitivity)})")
    assert sensitivity.mean().item() < ceiling


@pytest.mark.parametrize(
    "method, ceiling",
    [
        ("generic", 0.14),  # measured mean -0.005, sd 0.226, n = 24
        ("cdam", 0.17),  # measured mean -0.014, sd 0.287, n = 24
        ("gradcam", 0.18),  # measured mean 0.039, sd 0.214, n = 24
    ],
)
def test_randomising_all_blocks_destroys_the_maps(setup, method, ceiling):
    """Rank correlation with the trained model's maps after randomising head, norm and every block
    (Adebayo et al. 2018): near 0. Ceiling: measured mean + 3 sd / sqrt(n), rounded up."""
    model, x, (first, _), _, _ = setup
    blocks = [f"blocks.{i}" for i in reversed(range(len(model.blocks)))]
    layers = ["head", "norm", *blocks]
    result = vx.metrics.randomization_check(
        model,
        lambda m: vx.Explainer(m).explain(x[:24], method=method, target=first[:24]).maps,
        layers=layers,
    )
    final = result.correlations[-1]
    print(f"{method}: rank correlation after randomising every block {final.mean():.3f} (sd {final.std():.3f})")
    assert final.mean().item() < ceiling, f"{method}: {final.mean().item():.3f} >= {ceiling}"
