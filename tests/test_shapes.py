"""Tests of the synthetic shapes benchmark (vitexplain.data.synthetic)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from vitexplain.data import COLORS, MEAN, SHAPES, STD, ShapesBatch, shapes
from vitexplain.data.synthetic import denormalize, normalize

EVAL_SEED = 10_000


@pytest.fixture(scope="module")
def batch() -> ShapesBatch:
    return shapes(96, seed=EVAL_SEED)


def test_types_and_shapes(batch: ShapesBatch) -> None:
    n = len(batch)
    assert n == 96
    assert batch.images.shape == (n, 64, 64, 3) and batch.images.dtype == np.uint8
    assert batch.tensor.shape == (n, 3, 64, 64) and batch.tensor.dtype == torch.float32
    assert batch.labels.shape == (n, len(SHAPES)) and batch.labels.dtype == torch.float32
    assert len(batch.masks) == len(batch.classes) == len(batch.colors) == n
    assert len(batch.captions) == len(batch.word_objects) == n
    for m, c, col in zip(batch.masks, batch.classes, batch.colors):
        k = len(c)
        assert 1 <= k <= 3
        assert m.shape == (k, 64, 64) and m.dtype == torch.bool
        assert c.dtype == torch.long and col.dtype == torch.long and col.shape == (k,)
    assert len(SHAPES) >= 5 and len(COLORS) >= 4
    counts = batch.num_objects.tolist()
    assert {1, 2, 3} <= set(counts)


def test_deterministic() -> None:
    a, b = shapes(12, seed=3), shapes(12, seed=3)
    assert np.array_equal(a.images, b.images)
    assert a.captions == b.captions
    assert all(torch.equal(x, y) for x, y in zip(a.masks, b.masks))
    c = shapes(12, seed=4)
    assert not np.array_equal(a.images, c.images)


def test_image_independent_of_n_and_start() -> None:
    small, large = shapes(5, seed=7), shapes(11, seed=7)
    assert np.array_equal(small.images, large.images[:5])
    assert small.captions == large.captions[:5]
    tail = shapes(4, seed=7, start=7)
    assert np.array_equal(tail.images, large.images[7:])
    assert tail.indices.tolist() == [7, 8, 9, 10]


def test_masks_disjoint_nonempty_and_match_labels(batch: ShapesBatch) -> None:
    for i in range(len(batch)):
        m = batch.masks[i]
        assert (m.sum(dim=(1, 2)) > 20).all()  # every object is visible
        assert int(m.sum(0).max()) <= 1  # disjoint
        expected = torch.zeros(len(SHAPES))
        expected[batch.classes[i]] = 1.0
        assert torch.equal(batch.labels[i], expected)


def test_object_pixels_have_their_color(batch: ShapesBatch) -> None:
    # the nominal color is the closest of the palette to the mean pixel of each object
    from vitexplain.data.drawing import COLOR_RGB

    palette = torch.tensor(COLOR_RGB, dtype=torch.float32)
    img = torch.from_numpy(batch.images).float()
    for i in range(len(batch)):
        for m, col in zip(batch.masks[i], batch.colors[i]):
            mean_rgb = img[i][m].mean(0)
            assert int(torch.cdist(mean_rgb[None], palette).argmin()) == int(col)


def test_captions_left_to_right(batch: ShapesBatch) -> None:
    xs = torch.arange(64, dtype=torch.float32)
    for i in range(len(batch)):
        m = batch.masks[i].float()
        cx = (m.sum(1) * xs).sum(1) / m.sum((1, 2))
        assert bool((cx[1:] > cx[:-1]).all()), "objects must be sorted by centroid x"
        expected = " and ".join(
            f"{COLORS[int(c)]} {SHAPES[int(s)]}" for s, c in zip(batch.classes[i], batch.colors[i])
        )
        assert batch.captions[i] == expected


def test_word_objects(batch: ShapesBatch) -> None:
    for i in range(len(batch)):
        words = batch.captions[i].split(" ")
        objs = batch.word_objects[i]
        assert len(words) == len(objs)
        for w, o in zip(words, objs):
            if w == "and":
                assert o == -1
            elif w in COLORS:
                assert COLORS[int(batch.colors[i][o])] == w
            else:
                assert SHAPES[int(batch.classes[i][o])] == w


def test_forced_count_and_distinct_classes() -> None:
    b = shapes(40, seed=EVAL_SEED + 1, num_objects=2, distinct_classes=True)
    assert all(len(c) == 2 for c in b.classes)
    assert all(len(set(c.tolist())) == 2 for c in b.classes)
    assert all(int(lab.sum()) == 2 for lab in b.labels)
    b3 = shapes(20, seed=EVAL_SEED + 2, num_objects=3, distinct_classes=True, distinct_colors=True)
    assert all(len(set(c.tolist())) == 3 for c in b3.colors)
    b1 = shapes(10, seed=EVAL_SEED + 3, num_objects=(1, 1))
    assert all(len(c) == 1 for c in b1.classes)
    with pytest.raises(ValueError, match="num_objects must be in 1..3"):
        shapes(2, seed=0, num_objects=4)


def test_subset_and_getitem(batch: ShapesBatch) -> None:
    one = batch[3]
    assert len(one) == 1 and one.tensor.shape == (1, 3, 64, 64)
    assert one.captions == [batch.captions[3]]
    assert torch.equal(one.tensor[0], batch.tensor[3])
    sub = batch.subset([5, 1])
    assert sub.captions == [batch.captions[5], batch.captions[1]]
    assert torch.equal(sub.labels, batch.labels[[5, 1]])
    assert len(batch[2:8]) == 6
    with pytest.raises(IndexError, match="out of range"):
        batch[len(batch)]


def test_normalize_roundtrip(batch: ShapesBatch) -> None:
    x = batch.tensor
    ref = (torch.from_numpy(batch.images).permute(0, 3, 1, 2).float() / 255.0
           - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert torch.allclose(x, ref, atol=1e-5)
    assert np.array_equal(denormalize(x), batch.images)
    assert normalize(batch.images[0]).shape == (1, 3, 64, 64)
    # the constants really are the data statistics (loosely)
    assert abs(float(x.mean())) < 0.2 and 0.8 < float(x.std()) < 1.2


def test_other_sizes() -> None:
    b = shapes(4, seed=1, size=96, clutter=False)
    assert b.images.shape == (4, 96, 96, 3)
    assert b.masks[0].shape[1:] == (96, 96)


def test_import_is_light() -> None:
    code = (
        "import sys, vitexplain, vitexplain.data; vitexplain.explore; vitexplain.Explanation; "
        "assert 'cv2' not in sys.modules, 'cv2 imported'; "
        "assert 'timm' not in sys.modules, 'timm imported'; "
        "assert 'matplotlib' not in sys.modules and 'playwright' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_shapes_callable_whatever_was_imported_first() -> None:
    code = (
        "from vitexplain.data.drawing import SHAPES; import vitexplain as vx; "
        "b = vx.data.shapes(2, seed=1); assert len(b) == 2; "
        "from vitexplain.data import shapes; assert len(shapes(1, seed=0)) == 1"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
