"""A user's sweep of vx.metrics, vx.viz and saved explanations: arguments as users pass them (NumPy scalars,
floats where whole pixels are meant, infinite or NaN settings), invariants on a model whose output is a known
function of its pixels, the metrics on the zoo's plain and hierarchical models' maps, and comparisons with
Quantus 0.6 where its definition is the paper's (references.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import vitexplain as vx
from vitexplain import metrics as M
from vitexplain.errors import UsageError


class Linear(nn.Module):
    """Logit 0 = sum of w * x over every pixel, logit 1 = 0: the score is a known function of the pixels."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([(x * self.w).flatten(1).sum(1), torch.zeros(len(x), dtype=x.dtype)], 1)


def _linear(h: int = 6, w: int = 10) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    weights = torch.rand(1, 1, h, w, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.01
    return Linear(weights).eval(), torch.ones(2, 1, h, w, dtype=torch.float64), weights[0].expand(2, h, w)


def _logit(z: torch.Tensor) -> torch.Tensor:
    return z


# --- arguments as users pass them ------------------------------------------------------------------------------


def test_numpy_and_tensor_integers_are_whole_numbers_everywhere():
    # np.int64 (from mask.sum(), np.arange, a config) was refused as "must be an int" by steps, k, bins,
    # batch_size, samples and seed, while tolerance took NumPy numbers
    model, x, maps = _linear()
    want = M.deletion_auc(model, x, maps, 0, baseline="zero", score=_logit, steps=6, batch_size=5)
    got = M.deletion_auc(model, x, maps, 0, baseline="zero", score=_logit, steps=np.int64(6), batch_size=np.int32(5))
    assert torch.equal(got, want)
    masks = torch.zeros(2, 6, 10, dtype=torch.bool)
    masks[:, 1:4, 2:7] = True
    assert torch.equal(M.top_k_intersection(maps, masks, np.int64(7)), M.top_k_intersection(maps, masks, 7))
    assert torch.equal(M.top_k_intersection(maps, masks, masks[0].sum()), M.top_k_intersection(maps, masks, 15))
    assert torch.equal(M.histogram_entropy(maps, bins=np.int64(10)), M.histogram_entropy(maps, bins=10))
    assert torch.equal(M.pointing_game(maps, masks, rtol=np.float32(1e-5)), M.pointing_game(maps, masks))
    fn = lambda images: images[:, 0] * 2  # noqa: E731 - a linear explanation
    assert torch.equal(M.max_sensitivity(fn, x, samples=np.int64(3), seed=np.int64(1), radius=np.float32(0.5)),
                       M.max_sensitivity(fn, x, samples=3, seed=1, radius=0.5))
    # what is not a whole number stays refused, with the name in the message
    for bad in (2.0, True, "6", None):
        if bad is not None:  # (steps=None is every patch)
            with pytest.raises(UsageError, match="steps"):
                M.deletion_auc(model, x, maps, 0, steps=bad)
        with pytest.raises(UsageError, match="k must"):
            M.top_k_intersection(maps, masks, bad)


def test_a_patch_or_size_that_is_not_whole_pixels_is_a_usage_error():
    # patch=2.5 was a TypeError ("'float' object is not iterable"); size=(5.5, 6) was truncated to (5, 6)
    model, x, maps = _linear()
    with pytest.raises(UsageError, match="patch must be an int or a pair"):
        M.deletion_auc(model, x, maps, 0, patch=2.5)
    with pytest.raises(UsageError, match="size must be an int or a pair"):
        M.upsample_maps(maps, (5.5, 6))
    with pytest.raises(UsageError, match="size must be an int or a pair"):
        M.default_tolerance("64")
    assert M.upsample_maps(maps, (np.int64(12), 20)).shape == (2, 12, 20)
    assert M.default_tolerance(np.int64(448)) == 30
    assert torch.equal(M.deletion_auc(model, x, maps, 0, patch=(np.int64(2), 5), score=_logit),
                       M.deletion_auc(model, x, maps, 0, patch=(2, 5), score=_logit))


def test_an_infinite_blur_or_a_nan_baseline_is_named_as_such():
    model, x, maps = _linear()
    # blur_sigma=inf was an OverflowError (a kernel of infinite radius)
    for sigma in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(UsageError, match="blur_sigma must be a finite number"):
            M.deletion_auc(model, x, maps, 0, blur_sigma=sigma)
    # a NaN baseline was reported as the model's NaN logits ("check the model's weights")
    for baseline in (torch.full((1, 1, 1, 1), float("nan")), lambda images: images / 0.0):
        with pytest.raises(UsageError, match="baseline images hold NaN or infinite"):
            M.deletion_auc(model, x, maps, 0, baseline=baseline)


def test_randomisation_seeds_and_init_std_are_checked():
    # seed=0.5 was seeded as 0 (torch.manual_seed truncates), a negative init_std was torch's own error
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with pytest.raises(UsageError, match="seed must be an int"):
        M.randomized_copy(model, seed=0.5)
    with pytest.raises(UsageError, match="init_std"):
        M.randomization_check(model, lambda m: torch.rand(1, 2, 2), init_std=-1.0)
    a = M.randomized_copy(model, seed=np.int64(3))
    b = M.randomized_copy(model, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# --- saved explanations ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zoo():
    return {name: vx.Explainer(vx.zoo.load(name)) for name in ("shapes-vit", "shapes-hier")}


@pytest.fixture(scope="module")
def shapes():
    return vx.data.shapes(n=3, seed=5)


@pytest.mark.parametrize("name", ["shapes-vit", "shapes-hier"])
def test_save_then_load_keeps_the_extras_and_options_that_rerun_the_method(zoo, shapes, name, tmp_path):
    # extras were dropped (attnlrp's per-patch grid, score and conservation, although the docs promised all but
    # the images and logits), and a list option was written as its text ("[1, 2]"), which legrad then refused
    e = zoo[name].explain(shapes.images, method="attnlrp")
    back = vx.Explanation.load(e.save(tmp_path / "ré sultat ü"))  # a folder name with a space and non-ASCII
    assert set(back.extras) == set(e.extras) == {"pixels", "grid", "score", "conservation"}
    for key, value in e.extras.items():
        assert back.extras[key].dtype == value.dtype and torch.equal(back.extras[key], value.cpu())
    assert back.layout == e.layout and back.boxes == e.boxes and back.sources == e.sources
    layers = [0, 1] if name == "shapes-vit" else [3]  # (hier: its last stage has one call)
    e = zoo[name].explain(shapes.tensor, method="legrad", layers=layers)
    back = vx.Explanation.load(e.save(tmp_path / "legrad"))
    assert back.options == {"layers": layers} and back.extras == {}
    again = zoo[name].explain(shapes.tensor, method="legrad", **back.options)
    torch.testing.assert_close(again.maps.cpu(), back.maps, rtol=0, atol=0)


def test_nested_extras_survive_and_a_missing_extras_file_is_a_clear_error(zoo, shapes, tmp_path):
    e = zoo["shapes-vit"].explain(shapes.tensor, method="raw")
    e.extras = {"branches": {"fine (8x8)": torch.arange(6.0).view(2, 3)}, "combination": "branch 0 + branch 1",
                "steps": [1, torch.tensor([2, 3])], "ratio": np.float32(0.5)}
    back = vx.Explanation.load(e.save(tmp_path / "e"))
    assert torch.equal(back.extras["branches"]["fine (8x8)"], torch.arange(6.0).view(2, 3))
    assert back.extras["combination"] == "branch 0 + branch 1" and back.extras["ratio"] == 0.5
    assert back.extras["steps"][0] == 1 and torch.equal(back.extras["steps"][1], torch.tensor([2, 3]))
    (tmp_path / "e" / "extras.npz").unlink()
    with pytest.raises(UsageError, match="cannot load the extras"):
        vx.Explanation.load(tmp_path / "e")
    # saving again without extras leaves no stale extras file; saving over an earlier save is fine
    e.extras = {}
    e.save(tmp_path / "e")
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == ["manifest.json", "maps.npy"]


def test_saving_refuses_to_replace_files_no_save_wrote(zoo, shapes, tmp_path):
    # a data set's manifest.json (or the user's own maps.npy) in the folder was silently replaced
    e = zoo["shapes-vit"].explain(shapes.tensor, method="raw")
    for name, text in (("manifest.json", '{"images": ["a.png"]}'), ("maps.npy", "not ours")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / name).write_text(text)
        with pytest.raises(UsageError, match=f"holds {name} that no explanation's save wrote"):
            e.save(folder)
        assert (folder / name).read_text() == text


# --- rankings of upsampled maps --------------------------------------------------------------------------------


def _plateau_maps(n: int, seed: int) -> torch.Tensor:
    """(n, 8, 8) float32 maps of 4 levels: plateaus of equal cells, as ReLU-clamped or quantised maps have."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 8, 8, generator=gen) * 4).floor() * torch.rand(n, 1, 1, generator=gen)


def test_rank_accuracy_and_top_k_do_not_change_with_the_maps_scale():
    # bilinear weights round differently at different pixels, so values equal in exact arithmetic (a plateau,
    # the same level reached from two sides) were ranked by rounding that moves with the scale: 127 of 200
    # maps scored differently at 0.1x or 3x; ties at the cut now count by expectation whatever the scale
    maps = _plateau_maps(40, 0)
    masks = (torch.rand(40, 8, 8, generator=torch.Generator().manual_seed(1)) < 0.3)
    masks = masks.repeat_interleave(8, 1).repeat_interleave(8, 2)
    masks[:, :, :3] = False
    masks[:, 0, 0] = True  # no empty mask
    want_rank, want_top = M.relevance_rank_accuracy(maps, masks), M.top_k_intersection(maps, masks, 300)
    for scale, shift in ((0.7, 0.0), (0.1, 0.0), (1 / 3, 0.0), (3.0, -2.0), (1e-3, 0.0)):
        torch.testing.assert_close(M.relevance_rank_accuracy(maps * scale + shift, masks), want_rank,
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(M.top_k_intersection(maps * scale + shift, masks, 300), want_top, rtol=0, atol=1e-6)


def test_road_ranks_an_upsampled_plateau_as_a_tie_at_any_scale():
    # a constant map upsampled (0.1 in float32: three values 1e-8 apart) was removed in the rounding's order, a
    # regular pattern of pixels, not in the seeded random order of a tie; and 0.7x a map removed other pixels
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(32 * 32, 3)).eval()
    x = torch.rand(4, 1, 32, 32, generator=torch.Generator().manual_seed(2))
    maps = _plateau_maps(4, 3)
    kwargs = dict(target=0, fractions=(0.1, 0.3, 0.6), noise=0.0)
    want = M.road(model, x, maps, **kwargs).curves
    for scale, shift in ((0.7, 0.0), (0.1, 0.3), (3.0, -1.0)):
        torch.testing.assert_close(M.road(model, x, maps * scale + shift, **kwargs).curves, want, rtol=0, atol=1e-5)
    constant = [M.road(model, x, torch.full((4, 8, 8), v), **kwargs).curves for v in (1.0, 0.1, 0.7)]
    torch.testing.assert_close(constant[1], constant[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(constant[2], constant[0], rtol=0, atol=1e-5)


def test_deletion_with_a_patch_size_orders_patches_the_same_at_any_scale():
    # with patch=, each patch's mean of the bilinearly upsampled map was ranked as computed: patches equal in
    # exact arithmetic were ordered by rounding, differently at 0.7x (curves moved by up to 0.04)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(32 * 32, 3)).eval()
    x = torch.rand(8, 1, 32, 32, generator=torch.Generator().manual_seed(2))
    maps = _plateau_maps(8, 3)
    for patch in (4, (4, 8)):
        want = M.deletion_insertion(model, x, maps, 0, patch=patch, baseline="zero").curves
        for scale in (0.7, 0.1, 3.0):
            got = M.deletion_insertion(model, x, maps * scale, 0, patch=patch, baseline="zero").curves
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# --- invariants and oracles ------------------------------------------------------------------------------------


def test_deletion_of_a_linear_model_follows_the_hand_written_curve_and_the_perfect_order_wins():
    # zero baseline, raw logit: after deleting the n most relevant pixels the score is the sum of the other
    # weights, so the curve is known; ordering by the weights themselves gives the lowest AUC of any order
    model, x, maps = _linear(5, 7)
    w = maps[0].flatten()
    result = M.deletion_insertion(model, x, maps, 0, baseline="zero", score=_logit)
    remaining = w.sum() - torch.cat([torch.zeros(1, dtype=w.dtype), torch.sort(w, descending=True).values.cumsum(0)])
    torch.testing.assert_close(result.curves[0], remaining)
    assert result.fractions.tolist() == [n / 35 for n in range(36)]
    inserted = M.deletion_insertion(model, x, maps, 0, baseline="zero", score=_logit, mode="insertion")
    torch.testing.assert_close(inserted.curves[0, -1], w.sum())  # all inserted: the model's score on the image
    torch.testing.assert_close(inserted.curves[0, 0], torch.zeros((), dtype=w.dtype))
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        shuffled = torch.rand(2, 5, 7, generator=gen, dtype=torch.float64)
        assert (M.deletion_auc(model, x, shuffled, 0, baseline="zero", score=_logit) > result.auc).all()
        assert (M.insertion_auc(model, x, shuffled, 0, baseline="zero", score=_logit) < inserted.auc).all()


@pytest.mark.parametrize("name, method", [("shapes-vit", "rollout"), ("shapes-hier", "rollout"), ("shapes-hier", "cdam")])
def test_curve_ends_are_the_models_scores_on_stage_grid_maps(zoo, shapes, name, method):
    # shapes-hier's rollout is on its first stage's 16 x 16 grid, cdam on the last stage's 4 x 4
    ex = zoo[name]
    e = ex.explain(shapes.tensor, method=method)
    with torch.no_grad():
        probs = torch.softmax(ex.model(shapes.tensor), 1).gather(1, e.targets[:, None])[:, 0]
    steps = 8
    deletion = M.deletion_insertion(ex.model, shapes.tensor, e.maps, e.targets, steps=steps)
    insertion = M.deletion_insertion(ex.model, shapes.tensor, e.maps, e.targets, steps=steps, mode="insertion")
    torch.testing.assert_close(deletion.curves[:, 0], probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(insertion.curves[:, -1], probs, rtol=0, atol=1e-6)
    # the map on its grid and the same cells as pixel blocks with patch = the cell size order the same patches
    cell = 64 // e.maps.shape[-1]
    blocks = e.maps.repeat_interleave(cell, 1).repeat_interleave(cell, 2)
    on_pixels = M.deletion_insertion(ex.model, shapes.tensor, blocks, e.targets, steps=steps, patch=cell)
    torch.testing.assert_close(on_pixels.curves, deletion.curves, rtol=0, atol=1e-6)


def test_a_map_peaked_inside_the_box_points_at_it_on_any_grid_and_image_shape():
    # a non-square image (50 x 70) and grids that do not divide it; the peak cell lies wholly inside the box
    for grid, cell in (((5, 7), (2, 3)), ((4, 4), (1, 2)), ((16, 16), (7, 9))):
        h, w = 50, 70
        maps = torch.rand(2, *grid, generator=torch.Generator().manual_seed(0)) * 0.5
        maps[:, cell[0], cell[1]] = 1.0
        top, bottom = cell[0] * h // grid[0], -(-(cell[0] + 1) * h // grid[0])
        left, right = cell[1] * w // grid[1], -(-(cell[1] + 1) * w // grid[1])
        masks = torch.zeros(2, h, w, dtype=torch.bool)
        masks[:, max(0, top - 1): bottom + 1, max(0, left - 1): right + 1] = True
        assert M.pointing_game(maps, masks, tolerance=0).tolist() == [True, True]
        assert M.pointing_game(maps * 3 - 7, masks, tolerance=0).tolist() == [True, True]
        assert M.pointing_game(maps, ~masks, tolerance=0).tolist() == [False, False]


def test_relevance_mass_and_pointing_agree_with_quantus_where_the_definitions_do():
    # Quantus sums signed relevance and has no tolerance: non-negative maps at mask resolution with one maximum
    from peers import require

    quantus = require("quantus", "pip install --no-deps quantus==0.6.0 (see test_metrics_quantus.py)")
    gen = torch.Generator().manual_seed(0)
    b, h, w = 6, 20, 28
    maps = torch.rand(b, h, w, generator=gen, dtype=torch.float64)
    masks = torch.zeros(b, h, w, dtype=torch.bool)
    for i in range(b):
        masks[i, 2 + i: 10 + i, 3 + 2 * i: 15 + i] = True
    model = nn.Sequential(nn.Flatten(), nn.Linear(h * w, 2)).eval()
    args = dict(model=model, x_batch=np.random.default_rng(0).random((b, 1, h, w), dtype=np.float32),
                y_batch=np.zeros(b, int), a_batch=maps.numpy()[:, None].astype(np.float32),
                s_batch=masks.numpy()[:, None].astype(np.float32), device="cpu")
    mass = quantus.RelevanceMassAccuracy(disable_warnings=True)(**args)
    np.testing.assert_allclose(M.relevance_mass(maps, masks).numpy(), np.array(mass), rtol=0, atol=1e-6)
    hits = quantus.PointingGame(disable_warnings=True)(**args)
    assert M.pointing_game(maps, masks, tolerance=0).tolist() == [bool(v) for v in hits]
    assert 0 < sum(hits) < b  # both outcomes compared


# --- overlays and views ----------------------------------------------------------------------------------------


def test_a_float_image_is_told_the_conversion_that_fits_its_range():
    # the hint said x * 255 for every float image: followed for one already in [0, 255], it drew on white
    image = np.random.default_rng(0).integers(0, 256, (12, 20, 3)).astype(np.uint8)
    heat = np.random.default_rng(1).random((3, 5))
    want = vx.overlay(image, heat)
    for given, conversion in ((image.astype(np.float32), "np.clip(x, 0, 255)"),
                              (image / 255.0, "np.clip(x * 255, 0, 255)")):
        with pytest.raises(UsageError, match="float image") as info:
            vx.overlay(given, heat)
        assert conversion in str(info.value)
        converted = eval(conversion, {"np": np, "x": given}).round().astype(np.uint8)  # the advice, followed
        np.testing.assert_array_equal(vx.overlay(converted, heat), want)


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each run of True in a 1-D bool array."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(int), [0]])))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


def test_head_grid_keeps_a_non_square_grids_aspect():
    # a 48 x 80 input's 3 x 5 grid was stretched into square tiles (cells 20 x 12 px at tile=60)
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=64, depth=2,
                            dynamic_img_size=True).eval()
    with vx.capture(vit) as rec, torch.no_grad():
        vit(torch.rand(1, 3, 48, 80))
    assert rec.layout.grid == (3, 5)
    figure = vx.viz.head_grid(rec.records, rec.layout, tile=60)
    coloured = figure.max(2).astype(int) - figure.min(2) > 30  # viridis tiles; labels and background are gray
    (top, height), = _runs(coloured.any(1))[:1]
    spans = _runs(coloured[top:top + height].any(0))
    assert (height, spans[0][1]) == (36, 60) and len(spans) == 3  # 3 heads, each 3 x 5 cells of 12 px
    tile = figure[top:top + height, spans[0][0]:spans[0][0] + 60].astype(int)
    cells = tile.reshape(3, 12, 5, 12, 3)
    assert (cells == cells[:, :1, :, :1]).all()  # every cell one colour


def test_efficient_mprt_with_one_bin_says_so():
    # bins=1 puts every value in one bin: each map's entropy is 0, and the error said the explanations were constant
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    varied = lambda m: torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(0))  # noqa: E731
    with pytest.raises(UsageError, match="bins must be at least 2"):
        M.efficient_mprt(model, varied, bins=1)
    assert M.efficient_mprt(model, varied, bins=np.int64(2)).scores.shape == (2,)


def test_label_names_as_a_metric_target_are_told_to_be_indices():
    # explain() takes label names, the metrics class indices: names were an InputError about tensors
    from vitexplain.errors import TargetError

    model, x, maps = _linear()
    for names in ("star", ["star", "circle"]):
        with pytest.raises(TargetError, match="got label names"):
            M.deletion_auc(model, x, maps, names)
        with pytest.raises(TargetError, match="got label names"):
            M.road(model, x, maps, names, fractions=(0.5,))


def test_grid_and_colormap_arguments_of_the_wrong_kind_are_usage_errors():
    """Bug: ``grid(pad="x")`` and ``grid(text_color="red")`` raised bare ValueErrors from ``int()``, ``pad=None`` a
    TypeError, and ``colormap=["jet"]`` an unhashable-type TypeError from the colormap cache."""
    from vitexplain.viz import apply_colormap, colormap_lut, grid

    tile = np.zeros((8, 8, 3), np.uint8)
    for kwargs, what in [({"pad": "x"}, "pad"), ({"pad": None}, "pad"), ({"pad": -1}, "pad"),
                         ({"text_color": "red"}, "text_color"), ({"text_color": (0, 0)}, "text_color"),
                         ({"text_color": (0, 0, 300)}, "text_color")]:
        with pytest.raises(vx.UsageError, match=what):
            grid([tile], col_labels=["a"], **kwargs)
    with pytest.raises(vx.UsageError, match="colormap must be a name"):
        apply_colormap(np.zeros((4, 4)), colormap=["jet"])
    with pytest.raises(vx.UsageError, match="unknown colormap 'Jett'"):
        colormap_lut("Jett")
    fig = grid([tile, tile], col_labels=["a", "b"], pad=3, text_color=(255, 0, 0))  # the valid forms still draw
    red = (fig[..., 0].astype(int) - fig[..., 1]) > 100  # the label's (anti-aliased) red strokes
    assert fig.shape[1] == 3 + 2 * (8 + 3) and bool(red.any())
    assert (colormap_lut(" JET_r ") == colormap_lut("jet")[::-1]).all()
