"""Ground truth for the hierarchical family (issue 23, item 4): the bundled ``shapes-hier`` (a timm
Hiera with global attention, trained on the shapes data) explained by ``generic`` points at the
targeted object.

Images hold two objects of different classes; each class is targeted in turn and the peak of the
map must fall on that object (class-discriminative pointing, ``vx.metrics.pointing_game``).
Fresh seeds that training never saw (training uses seeds < 9,000).
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx

N_IMAGES = 200
# candidates were screened on seed 20,000 and compared on 20,000 / 21,000 / 22,000
# (benchmarks/hier_pointing.py; vitexplain/zoo/train.py); the floor is measured here
SEED = 21_000


@pytest.fixture(scope="module")
def setup():
    model = vx.zoo.load("shapes-hier")
    batch = vx.data.shapes(N_IMAGES, seed=SEED, num_objects=2, distinct_classes=True)
    targets = tuple(torch.stack([c[k] for c in batch.classes]) for k in (0, 1))
    masks = tuple(torch.stack([m[k] for m in batch.masks]) for k in (0, 1))
    return model, batch.tensor, targets, masks


# Floor: measured on 400 images of seed 21,000 (n = 800 (image, target) pairs; these 200 images are
# its first half): 0.957 (python benchmarks/hier_pointing.py --seed 21000 --n 400; 0.967 on seed
# 20,000, 0.950 on 22,000), minus three binomial standard errors of this test's n = 400 pairs,
# 3 sqrt(0.957 * 0.043 / 400) = 3 * 0.0101 = 0.030 -> 0.927, rounded down to 2 decimals.
GENERIC_FLOOR = 0.92


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


@pytest.mark.parametrize("arch, windowed", [(None, [False, False, False, False]),
                                             ("hiera-global", [False, False, False, False]),
                                             ("hiera", [True, True, True, False]),
                                             ("pvt", None)])
def test_the_variants_train_reload_and_are_explained(arch, windowed, tmp_path) -> None:
    """``python -m vitexplain.zoo.train shapes-hier [--arch hiera-global | hiera | pvt]``
    (vitexplain/zoo/train.py says why each was tried): two steps train, the checkpoint reloads as
    the variant's timm model (a Hiera whose blocks attend in mask units or globally as the variant
    says; the default is the bundled global one), and the hierarchical family explains it on its
    three stage grids."""
    from timm.models.hiera import Hiera
    from timm.models.pvt_v2 import PyramidVisionTransformerV2

    from vitexplain.zoo import train as zoo_train

    flag = [] if arch is None else ["--arch", arch]
    assert zoo_train.main(["shapes-hier", *flag, "--out", str(tmp_path), "--steps", "2", "--batch-size",
                           "4", "--val-images", "0", "--final-eval-images", "0"]) == 0
    model = vx.zoo.load_checkpoint(str(tmp_path / "shapes-hier.json"))
    assert type(model) is (PyramidVisionTransformerV2 if arch == "pvt" else Hiera) and not model.training
    if windowed is not None:
        assert [blk.attn.use_mask_unit_attn for blk in model.blocks] == windowed
    ex = vx.Explainer(model)
    assert ex.family == "hier"
    assert [st.grid for st in ex.adapter.stage_sets((64, 64))] == [(16, 16), (8, 8), (4, 4)]
    x = vx.data.shapes(2, seed=SEED).tensor
    for stage, side in ((0, 16), (1, 8), (2, 4)):
        assert ex.explain(x, method="cdam", stage=stage, target=0).maps.shape == (2, side, side)
    with pytest.raises(vx.UsageError, match="only shapes-hier"):
        zoo_train.main(["shapes-vit", "--arch", "hiera", "--out", str(tmp_path), "--steps", "1"])
