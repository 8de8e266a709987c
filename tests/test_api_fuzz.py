"""What a new user types, fuzzed: images, maps, sizes and options of the Python API and ``vx.viz`` that were
crashes (OpenCV writing outside its image), silent wrong figures (a value range that drew every cell in one
colour, contour levels that drew nothing, an empty grid), or bare NumPy / OpenCV / Python errors. Each bad
input must be a vitexplain error saying what is wrong; each good one must give the right picture, checked
against a blend or a colour computed here by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import vitexplain as vx
from vitexplain.viz.colormaps import colormap_lut

pytestmark = pytest.mark.usefixtures("one_thread")


def _image(h: int = 24, w: int = 36, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _blend(image: np.ndarray, values: np.ndarray, alpha: float, colormap: str) -> np.ndarray:
    """The overlay formula written out: ``rint((1 - a) * image + a * lut[rint(255 v)])``, v already in [0, 1]."""
    colour = colormap_lut(colormap)[np.rint(values * 255).astype(int)].astype(np.float64)
    return np.clip(np.rint((1 - alpha) * image.astype(np.float64) + alpha * colour), 0, 255).astype(np.uint8)


# -- overlays -------------------------------------------------------------------------------------


def test_an_overlay_is_the_blend_written_out():
    image = _image()
    values = np.random.default_rng(1).random(image.shape[:2])
    got = vx.overlay(image, values, alpha=0.3, colormap="viridis", normalize="none", interpolation="nearest")
    diff = np.abs(got.astype(int) - _blend(image, values.astype(np.float32), 0.3, "viridis").astype(int))
    assert diff.max() <= 1  # float32 vs float64 rounding of the blend


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "I;16", "CMYK"])
def test_a_pil_image_of_any_mode_is_drawn_on_as_explain_reads_it(mode):
    """explain() takes PIL images of every mode (converted as load_image converts a file); overlay refused
    all but RGB ('must be an (H, W, 3) uint8 RGB array, got shape (24, 36)')."""
    rgb = _image()
    pil = Image.fromarray(rgb).convert(mode)
    if mode == "RGBA":  # half transparent: composited on white
        pil.putalpha(128)
    values = np.random.default_rng(2).random((4, 6))
    want = vx.overlay(vx.data.arrays.as_rgb(pil), values, alpha=0.4)
    np.testing.assert_array_equal(vx.overlay(pil, values, alpha=0.4), want)
    if mode == "L":  # the gray levels, repeated to three channels
        gray = np.repeat(np.asarray(pil)[..., None], 3, axis=2)
        np.testing.assert_array_equal(want, vx.overlay(gray, values, alpha=0.4))
    if mode == "RGBA":  # alpha 128 on white, written out
        white = np.rint(rgb * (128 / 255) + 255 * (1 - 128 / 255))
        assert np.abs(vx.data.arrays.as_rgb(pil).astype(int) - white).max() <= 1


@pytest.mark.parametrize("alpha, message", [
    (None, "alpha must be a finite number, got NoneType"),  # was a TypeError from float()
    ("0.5", "alpha must be a finite number, got str"),  # a string was read as a number
    (True, "alpha must be a finite number, got bool"),
    (float("nan"), "finite"),
    (1.5, r"alpha must be in \[0, 1\]"),
])
def test_bad_alpha(alpha, message):
    with pytest.raises(vx.UsageError, match=message):
        vx.overlay(_image(), np.ones((2, 2)), alpha=alpha)


def test_numpy_and_tensor_scalars_are_numbers():
    image, values = _image(), np.random.default_rng(3).random((3, 3))
    want = vx.overlay(image, values, alpha=0.25, contour=0.5)
    np.testing.assert_array_equal(vx.overlay(image, values, alpha=np.float32(0.25), contour=np.float32(0.5)), want)
    np.testing.assert_array_equal(vx.overlay(image, values, alpha=torch.tensor(0.25), contour=[np.float64(0.5)]), want)


@pytest.mark.parametrize("contour", [1.5, -0.2, float("nan"), [0.3, 2.0], "x"])
def test_contour_levels_outside_the_normalised_range_are_refused(contour):
    """A level outside [0, 1] drew no line at all (the mask was empty or the whole image), silently."""
    with pytest.raises(vx.UsageError, match="contour level"):
        vx.overlay(_image(), np.random.default_rng(4).random((4, 4)), contour=contour)


# -- matrices, grids, colour bars, caption figures -------------------------------------------------


@pytest.mark.parametrize("font_scale", [-1.0, 0, float("nan"), None])
def test_a_label_font_scale_that_cannot_be_drawn_is_refused(font_scale):
    """A negative font scale made OpenCV's putText write outside the figure: the process died of a
    segmentation fault; 0 drew no labels at all."""
    with pytest.raises(vx.UsageError, match="font_scale"):
        vx.viz.attention_matrix(np.random.default_rng(5).random((3, 4)), font_scale=font_scale)
    if font_scale is not None:
        with pytest.raises(vx.UsageError, match="font_scale"):
            vx.viz.grid([_image()], col_labels=["a"], font_scale=font_scale)


@pytest.mark.parametrize("vmin, vmax", [(1.0, 0.0), (0.5, 0.5), (None, -1.0), (2.0, None)])
def test_a_value_range_with_nothing_in_it_is_refused(vmin, vmax):
    """vmin >= vmax drew every cell in the bottom colour, under a colour bar whose ticks said otherwise."""
    with pytest.raises(vx.UsageError, match=r"vmin .* must be below vmax .*the weights span \[0, 1\]"):
        vx.viz.attention_matrix(np.array([[0.0, 0.5, 1.0]]), vmin=vmin, vmax=vmax)


@pytest.mark.parametrize("vmin, vmax", [(float("nan"), None), (None, float("inf")), ("0", None)])
def test_a_value_range_that_is_not_numbers_is_refused(vmin, vmax):
    """A NaN vmin was an IndexError from the colour lookup; an infinite vmax drew every cell in one colour."""
    with pytest.raises(vx.UsageError, match="must be a finite number"):
        vx.viz.attention_matrix(np.array([[0.0, 0.5, 1.0]]), vmin=vmin, vmax=vmax)


def test_a_given_value_range_colours_the_cells_by_it():
    """Values are placed on [vmin, vmax] and clipped: with vmin 0.5, vmax 1 the cells 0, 0.5, 0.75, 1 take
    colours 0, 0, round(127.5) = 128 and 255 of the table."""
    lut = colormap_lut("viridis")
    fig = vx.viz.attention_matrix(np.array([[0.0, 0.5, 0.75, 1.0]]), vmin=0.5, vmax=1.0, cell=10)
    top = np.argwhere((fig == lut[255]).all(-1))
    top = top[top[:, 1] < top[:, 1].max() - 20]  # the cell, not the colour bar
    y, x_last = top[:, 0].min() + 5, top[:, 1].min() + 5  # the centre of the last cell
    centres = [fig[y, x_last - 10 * (3 - c)] for c in range(4)]
    for c, want in enumerate((0, 0, 128, 255)):
        np.testing.assert_array_equal(centres[c], lut[want])


@pytest.mark.parametrize("kwargs, message", [
    ({"cell": -3}, "cell must be in"),
    ({"cell": 2.5}, "cell must be a whole number"),
    ({"cell": 10_000}, "cell must be in"),  # a 10 GB figure
    ({"max_labels": 0}, "max_labels must be >= 1"),
])
def test_matrix_sizes_that_cannot_be_drawn_are_refused(kwargs, message):
    with pytest.raises(vx.UsageError, match=message):
        vx.viz.attention_matrix(np.random.default_rng(6).random((5, 7)), **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"tile_size": (0, 0)}, "tile_size must be >= 1"),  # was an empty 8 x 8 figure
    ({"tile_size": (-5, 10)}, "tile_size must be >= 1"),
    ({"tile_size": (10, 2.5)}, "tile_size must be a whole number"),
    ({"background": 300}, r"background .* must be in \[0, 255\]"),
    ({"background": -1}, r"background .* must be in \[0, 255\]"),
])
def test_grid_sizes_and_gray_levels_that_cannot_be_drawn_are_refused(kwargs, message):
    with pytest.raises(vx.UsageError, match=message):
        vx.viz.grid([_image()], **kwargs)


def test_a_grid_takes_pil_images_tensors_and_a_square_tile_size():
    """A flat list of PIL images was read as rows (TypeError: 'Image' object is not iterable), and an int
    tile size was a TypeError."""
    a, b = _image(seed=1), _image(seed=2)
    want = vx.viz.grid([a, b], tile_size=(24, 24))
    np.testing.assert_array_equal(vx.viz.grid([Image.fromarray(a), torch.from_numpy(b)], tile_size=24), want)
    np.testing.assert_array_equal(vx.viz.grid(Image.fromarray(a)), vx.viz.grid(a))


@pytest.mark.parametrize("kwargs, message", [
    ({"width": 0}, "width"),  # an OpenCV error
    ({"width": -5}, "width"),  # a NumPy error
    ({"width": 100, "height": -3}, "height"),
    ({"width": 100, "scale": float("nan")}, "scale"),  # written "nan" under the bar
    ({"width": 100, "scale": -1.0}, "scale"),  # written "--1 against"
])
def test_colour_bars_that_cannot_be_drawn_are_refused(kwargs, message):
    with pytest.raises(vx.UsageError, match=message):
        vx.viz.colorbar(signed=True, **kwargs)


def test_a_colour_bar_under_a_pil_image():
    image = _image()
    got = vx.viz.with_colorbar(Image.fromarray(image), signed=False)
    np.testing.assert_array_equal(got[: image.shape[0]], image)
    np.testing.assert_array_equal(got[image.shape[0]:], vx.viz.colorbar(image.shape[1], signed=False))


def test_caption_figures_with_too_few_maps_or_no_columns_are_refused():
    image, maps = _image(), np.random.default_rng(7).random((2, 4, 4))
    with pytest.raises(vx.UsageError, match="got 2 maps for 3 words"):  # was an IndexError
        vx.viz.caption_figure(image, ["a", "b", "c"], maps)
    for columns in (0, -1):  # -1 was an IndexError
        with pytest.raises(vx.UsageError, match="columns must be >= 1"):
            vx.viz.caption_figure(image, ["a", "b"], maps, columns=columns)
    np.testing.assert_array_equal(vx.viz.caption_figure(Image.fromarray(image), ["a", "b"], maps),
                                  vx.viz.caption_figure(image, ["a", "b"], maps))


def test_a_png_or_page_path_that_cannot_be_a_file_is_a_usage_error(tmp_path):
    """A path below a file was a bare FileExistsError, a folder an IsADirectoryError, None a TypeError."""
    (tmp_path / "file").write_text("x")
    image = _image()
    for path, message in ((tmp_path / "file" / "a.png", "is a file, not a folder"), (tmp_path, "it is a folder"),
                          (None, "must be a file path")):
        with pytest.raises(vx.UsageError, match=message):
            vx.viz.save_png(path, image)
    written = vx.viz.save_png(tmp_path / "new" / "deeper" / "a.png", image)  # missing folders are created
    np.testing.assert_array_equal(np.asarray(Image.open(written)), image)


# -- explanations ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ex():
    return vx.Explainer(vx.zoo.load("shapes-vit"))


@pytest.fixture(scope="module")
def wide():
    """A 300 x 200 image: the 64 px model sees its centre crop, x in [50, 250)."""
    return np.asarray(Image.fromarray(vx.data.shapes(n=1, seed=5).images[0]).resize((300, 200)))


def test_an_overlay_on_the_original_image_puts_the_map_on_the_crop_the_model_saw(ex, wide):
    """e.overlay(i, image=original) stretched the map of the centre crop over the whole photo: every patch's
    colour sat on pixels it is not about, silently. The map is now placed on the crop box: outside it a
    signed map is clear (the image as it is), a non-negative one the lowest colour; inside, the overlay
    matches an overlay drawn on the crop itself (up to resampling twice: measured mean |diff| 0.24 and 1.5
    levels here, against 3.3 and 14 for the stretched map)."""
    for method, most in (("cdam", 1.0), ("rollout", 3.0)):
        e = ex.explain(wide, method=method)
        assert (e.boxes[0].left, e.boxes[0].right) == (50.0, 250.0)
        got = e.overlay(0, image=wide)
        mode = "signed" if e.signed else "minmax"
        on_crop = vx.overlay(np.ascontiguousarray(wide[:, 50:250]), e.maps[0], normalize=mode)
        assert np.abs(got[:, 50:250].astype(int) - on_crop.astype(int)).mean() <= most
        outside = np.concatenate([wide[:, :50], wide[:, 250:]], axis=1)
        drawn = np.concatenate([got[:, :50], got[:, 250:]], axis=1)
        if e.signed:
            np.testing.assert_array_equal(drawn, outside)
        else:
            np.testing.assert_array_equal(drawn, _blend(outside, np.zeros(outside.shape[:2]), 0.5, "jet"))
        np.testing.assert_array_equal(e.overlay(0, image=Image.fromarray(wide)), got)  # a PIL image: the same
        assert e.overlay(0).shape == (64, 64, 3)  # the stored region, as before


@pytest.mark.parametrize("index", [np.int64(1), np.int32(-1), torch.tensor(1)])
def test_numpy_and_tensor_integers_index_images(ex, index):
    """An index from argmax (a NumPy or 0-d torch integer) was refused as 'not an integer image index'."""
    e = ex.explain(vx.data.shapes(n=2, seed=1).images, method="rollout")
    np.testing.assert_array_equal(e.overlay(index), e.overlay(1))
    with pytest.raises(vx.UsageError, match="integer image index"):
        e.overlay(np.float64(1.0))


def test_repr_is_one_line_not_every_value(ex):
    """The dataclass repr printed every map value and logit (thousands of lines for a batch of 224 px maps)."""
    e = ex.explain(vx.data.shapes(n=6, seed=2).images, method="rollout", head_fusion="max")
    text = repr(e)
    assert "\n" not in text and len(text) < 300
    names = e.target_names()
    assert text == (f"Explanation(method='rollout', maps=(6, 8, 8) float32, signed=False, targets=[{names[0]!r}, "
                    f"{names[1]!r}, {names[2]!r}, {names[3]!r}, ... 2 more], input_size=(64, 64), images=6, "
                    "options={'head_fusion': 'max'})")


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_show_with_no_images_is_refused(ex, bad):
    """show(0) was matplotlib's 'Number of columns must be a positive integer'."""
    e = ex.explain(vx.data.shapes(n=1, seed=2).tensor, method="rollout")
    with pytest.raises(vx.UsageError, match="max_images must be"):
        e.show(bad)


def test_save_into_a_path_that_cannot_be_a_folder(ex, tmp_path):
    """save(None) was a TypeError, save('') wrote into the working folder, a path below a file a bare
    NotADirectoryError; a folder is created with the maps and what they are."""
    e = ex.explain(vx.data.shapes(n=2, seed=3).tensor, method="cdam", target=[1, 4])
    (tmp_path / "file").write_text("x")
    for bad, message in ((None, "folder path"), ("", "folder path"), (tmp_path / "file" / "out", "is a file")):
        with pytest.raises(vx.UsageError, match=message):
            e.save(bad)
    out = e.save(tmp_path / "a" / "b")
    np.testing.assert_array_equal(np.load(out / "maps.npy"), e.maps.numpy())
    import json

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["targets"] == [1, 4] and manifest["target_names"] == ["square", "cross"]


def test_a_caption_explanation_saves_and_upsamples_as_an_explanation_does(tmp_path):
    """CaptionExplanation had no save() (AttributeError) and its upsample() took no mode."""
    cap = vx.Explainer(vx.zoo.load("shapes-captioner"))
    e = cap.explain_caption(vx.data.shapes(n=2, seed=4).images, method="cross", max_len=4)
    assert repr(e).startswith("CaptionExplanation(method='cross', maps=(2, ") and "\n" not in repr(e)
    out = e.save(tmp_path / "cap")
    np.testing.assert_array_equal(np.load(out / "maps.npy"), e.maps.numpy())
    import json

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["captions"] == e.captions and manifest["tokens"] == e.tokens and manifest["ids"] == e.ids.tolist()
    want = torch.nn.functional.interpolate(e.maps.flatten(0, 1)[:, None], size=(16, 16), mode="nearest")
    torch.testing.assert_close(e.upsample(16, mode="nearest"), want[:, 0].reshape(2, -1, 16, 16))
    with pytest.raises(vx.UsageError, match="mode must be one of"):
        e.upsample(16, mode="cubic")


def test_the_notebook_colour_bar_of_a_minmax_overlay_starts_at_the_maps_minimum(ex):
    """The overlay of a non-negative map is normalised min-max, so its bottom colour is the map's minimum;
    the colour bar under it said 0 (a map spanning 0.4 .. 0.6 read as 0 .. 0.6)."""
    from vitexplain.viz.notebook import explanation_tiles

    e = ex.explain(vx.data.shapes(n=1, seed=6).images, method="rollout")
    m = e.maps[0]
    assert float(m.min()) > 0.05 * float(m.max())  # far from 0: a bar starting at 0 would be wrong
    tile = explanation_tiles(e)[0][0]
    bar = vx.viz.colorbar(tile.shape[1], signed=False, scale=float(m.max()), low=float(m.min()))
    np.testing.assert_array_equal(tile[-bar.shape[0]:], bar)
    assert not np.array_equal(bar, vx.viz.colorbar(tile.shape[1], signed=False, scale=float(m.max())))
    blank = vx.viz.colorbar(tile.shape[1], signed=False, scale=float(m.max()), low=0)
    np.testing.assert_array_equal(blank, vx.viz.colorbar(tile.shape[1], signed=False, scale=float(m.max())))


def test_construction_errors_say_what_to_pass(ex):
    with pytest.raises(vx.UsageError, match="adapter= must be a vitexplain Adapter"):  # an AttributeError later
        vx.Explainer(ex.model, adapter=5)
    # DataParallel runs copies of the model that no hook sees: explain the model it wraps
    with pytest.raises(vx.UnsupportedModelError, match=r"vx.Explainer\(model.module\)"):
        vx.Explainer(torch.nn.DataParallel(ex.model))


@pytest.fixture(scope="module")
def recorded(ex):
    with torch.no_grad(), vx.capture(ex.model) as rec:
        ex.model(vx.data.shapes(n=2, seed=8).tensor)
    return rec


def test_head_grid_and_record_matrix_take_numpy_integers_and_refuse_sizes_they_cannot_draw(recorded):
    """A tile of 0 px was an OpenCV assertion, a missing layout an AttributeError, a NumPy query or head was
    refused ('unknown head fusion np.int64(1)')."""
    recs, layout = recorded.records, recorded.layout
    np.testing.assert_array_equal(vx.viz.head_grid(recs, layout, query=np.int64(3), tile=16),
                                  vx.viz.head_grid(recs, layout, query=3, tile=16))
    np.testing.assert_array_equal(vx.viz.record_matrix(recs[0], head=np.int64(1)), vx.viz.record_matrix(recs[0], head=1))
    for kwargs, message in (({"tile": 0}, "tile"), ({"query": layout.num_tokens}, "query"),
                            ({"index": 2}, "image index 2 is out of range: the record holds 2")):
        with pytest.raises(vx.UsageError, match=message):
            vx.viz.head_grid(recs, layout, **kwargs)
    with pytest.raises(vx.UsageError, match="token layout"):
        vx.viz.head_grid(recs, None)
    with pytest.raises(vx.UsageError, match="needs a layout"):
        vx.viz.token_labels(None)
    assert vx.viz.token_labels(None, 3) == ["0", "1", "2"]


def test_a_callable_target_is_named_as_a_score_not_as_class_minus_one(ex, tmp_path):
    """A callable target is stored as class -1; target_names() (the notebook's titles, the saved manifest) gave
    "-1", which reads like a class."""
    def margin(out):
        return out[:, 1] - out[:, 2]

    e = ex.explain(vx.data.shapes(n=2, seed=9).tensor, method="cdam", target=margin)
    assert e.targets.tolist() == [-1, -1] and e.target_names() == ["score margin", "score margin"]
    import json

    assert json.loads((e.save(tmp_path / "s") / "manifest.json").read_text())["target_names"] == ["score margin"] * 2
    assert ex.explain(vx.data.shapes(n=1, seed=9).tensor, method="cdam", target=2).target_names() == ["triangle"]


@pytest.mark.parametrize("bad, message", [
    (None, "got NoneType"),  # said "got shape () dtype object"
    ({"image": 1}, "got dict"),
    (3, "got int"),
])
def test_what_is_not_an_image_is_named(ex, bad, message):
    with pytest.raises(vx.UsageError, match=message):
        ex.explain(bad, method="rollout")


def test_an_image_of_rows_of_different_lengths_is_named():
    """A nested list whose rows differ in length (an image built row by row, one row short) raised NumPy's bare
    ValueError ('inhomogeneous shape') out of explain() and overlay()."""
    ragged = [[[0, 0, 0]] * 4] * 3 + [[[0, 0, 0]] * 5]
    ex = vx.Explainer(vx.zoo.load("shapes-vit"))
    with pytest.raises(vx.UsageError, match=r"rows of different lengths"):
        ex.explain([ragged], method="rollout")
    with pytest.raises(vx.UsageError, match=r"rows of different lengths"):
        vx.overlay(ragged, torch.zeros(2, 2))


def test_a_list_of_preprocessed_tensors_is_told_to_stack_them(ex):
    """A list of (3, H, W) float tensors was told to convert them to uint8 ('float image? convert with
    np.clip(x * 255, ...)'), which would explain garbage: they are a batch to stack."""
    x = vx.data.shapes(n=2, seed=10).tensor
    with pytest.raises(vx.UsageError, match=r"torch.stack") as info:
        ex.explain([x[0], x[1]], method="rollout")
    assert "x * 255" not in str(info.value)


def test_a_generator_of_images_is_its_images(ex):
    """explore() took a generator of images; explain() refused one."""
    images = vx.data.shapes(n=2, seed=11).images
    got = ex.explain((im for im in images), method="rollout")
    torch.testing.assert_close(got.maps, ex.explain(list(images), method="rollout").maps)


def test_a_method_named_twice_is_refused(ex):
    """['cdam', 'cdam', 'rollout'] gave two results: zipped with the names, the rollout map was labelled cdam."""
    x = vx.data.shapes(n=1, seed=12).tensor
    with pytest.raises(vx.UsageError, match=r"method 'cdam' is named more than once"):
        ex.explain(x, method=["cdam", "cdam", "rollout"])
    got = ex.explain(x, method=["cdam", "rollout"])
    assert [e.method for e in got] == ["cdam", "rollout"]


def test_numpy_integer_counts(ex, tmp_path):
    """max_len=np.int64(3) and top_k=np.int64(2) were refused as not positive integers."""
    cap = vx.Explainer(vx.zoo.load("shapes-captioner"))
    x = vx.data.shapes(n=1, seed=13).tensor
    got = cap.explain_caption(x, method="cross", max_len=np.int64(3))
    torch.testing.assert_close(got.maps, cap.explain_caption(x, method="cross", max_len=3).maps)
    image = vx.data.shapes(n=1, seed=13).images[0]
    page = vx.explore(ex, image, tmp_path / "p.html", method="rollout", top_k=np.int64(2),
                      attention_budget=np.float32(1.0))  # (also refused: not an int or float)
    assert page.is_file()
    with pytest.raises(vx.UsageError, match="max_len must be a positive number"):
        cap.explain_caption(x, method="cross", max_len=np.float64(3.0))


def test_matrix_weights_near_the_float32_limit_keep_their_colours():
    """(w - min) overflowed float32 for weights spanning +-3e38: the cells' colour indices were NaN cast to
    integers (garbage colours), with only a RuntimeWarning."""
    lut = colormap_lut("viridis")
    fig = vx.viz.attention_matrix(np.array([[-3e38, 0.0, 3e38]], np.float32), cell=10)
    top = np.argwhere((fig == lut[255]).all(-1))
    top = top[top[:, 1] < top[:, 1].max() - 20]
    y, x = top[:, 0].min() + 5, top[:, 1].min() + 5  # centre of the last cell
    for c, want in enumerate((0, 128, 255)):
        np.testing.assert_array_equal(fig[y, x - 10 * (2 - c)], lut[want])


def test_a_float64_map_is_normalised_at_its_own_precision():
    """Through float32, a float64 map of values below 1e-38 became all zeros (a blank overlay) and one above
    3e38 all inf ('the method failed numerically'): both are the same picture as the map scaled to 1."""
    image = _image()
    m = np.random.default_rng(14).random((4, 4))
    for scale in (1e-300, 1e300):
        np.testing.assert_array_equal(vx.overlay(image, m * scale), vx.overlay(image, m))
        np.testing.assert_array_equal(vx.overlay(image, torch.from_numpy(m * scale)), vx.overlay(image, m))


@pytest.mark.parametrize("bad, message", [
    ("abc", "must hold numbers"),  # a bare ValueError
    (np.ones((3, 3), np.complex64), "must hold real numbers"),  # the imaginary part was dropped with a warning
    (torch.ones(3, 3, dtype=torch.complex64), "must hold real numbers"),
])
def test_maps_that_are_not_real_numbers_are_refused(bad, message):
    with pytest.raises(vx.UsageError, match=message):
        vx.overlay(_image(), bad)


def test_channel_tiles_check_their_index_and_count():
    """An index past the batch was an IndexError, k='3' a TypeError, a gray PIL image refused."""
    cnn = vx.Explainer(vx.zoo.load("shapes-cnn"))
    images = vx.data.shapes(n=2, seed=15).images
    e = cnn.explain(images, method="channel")
    for kwargs, message in (({"index": 2}, "image index 2 is out of range"), ({"k": "3"}, "k must be a whole number"),
                            ({"k": 0}, "k must be >= 1")):
        with pytest.raises(vx.UsageError, match=message):
            vx.viz.channel_tiles(images[1], e, **kwargs)
    np.testing.assert_array_equal(vx.viz.channel_tiles(images[1], e, index=np.int64(-1), k=np.int64(2)),
                                  vx.viz.channel_tiles(images[1], e, index=1, k=2))
    gray = Image.fromarray(images[0]).convert("L")
    np.testing.assert_array_equal(vx.viz.channel_tiles(gray, e, k=2),
                                  vx.viz.channel_tiles(np.repeat(np.asarray(gray)[..., None], 3, axis=2), e, k=2))


@pytest.mark.parametrize("empty", [[], (), np.zeros((0, 64, 64, 3), np.uint8), iter([])])
def test_no_images_says_what_to_pass(ex, empty):
    with pytest.raises(vx.UsageError, match="no images to explain: pass a path"):  # "preprocess got no images"
        ex.explain(empty, method="rollout")


def test_gallery_arguments(tmp_path):
    """methods='cdam' made four columns 'c', 'd', 'a', 'm' (each empty); thumb_px 0 or -5 was written into the
    page's style, 'x' was a ValueError; a record that is not a dict an AttributeError; a path below a file a
    bare FileExistsError."""
    record = {"key": "a.png", "status": "ok", "files": {"cdam": {"overlay": "a.cdam.png"}},
              "predictions": [{"index": 1, "label": "dog", "score": 0.25}], "target": {"index": 1, "label": "dog"}}
    page = vx.viz.render_gallery([record], folder=tmp_path, methods="cdam")
    assert page.count("<th>cdam</th>") == 1 and "<th>c</th>" not in page
    assert page == vx.viz.render_gallery([record], folder=tmp_path, methods=["cdam"])
    for kwargs, message in (({"thumb_px": 0}, "thumb_px"), ({"thumb_px": "x"}, "thumb_px")):
        with pytest.raises(vx.UsageError, match=message):
            vx.viz.render_gallery([record], folder=tmp_path, **kwargs)
    for records in (["a.png"], None, [dict(record, files=["a.cdam.png"])]):
        with pytest.raises(vx.UsageError, match="manifest record"):
            vx.viz.render_gallery(records, folder=tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(vx.UsageError, match="is a file, not a folder"):
        vx.viz.write_gallery(tmp_path / "file" / "index.html", [record])
    assert "cdam: dog" in vx.viz.write_gallery(tmp_path / "g" / "index.html", [record]).read_text()


def test_one_grid_label_is_a_label_not_its_letters():
    """col_labels="ab" over two tiles labelled them "a" and "b"; one string is the label of one column."""
    a = _image()
    np.testing.assert_array_equal(vx.viz.grid([a], col_labels="cdam"), vx.viz.grid([a], col_labels=["cdam"]))
    with pytest.raises(vx.UsageError, match="1 column labels for 2 columns"):
        vx.viz.grid([a, a], col_labels="ab")


def test_an_image_files_bytes_are_an_image_and_an_empty_path_is_named(ex):
    """load_image took an image file's bytes, explain() refused them ('got bytes'); load_image('') said the
    path 'is a directory' (the working folder)."""
    path = "assets/samples/04_blue_star_and_green_circle.png"
    with open(path, "rb") as f:
        data = f.read()
    got = ex.explain([data, path], method="rollout")
    torch.testing.assert_close(got.maps[0], got.maps[1])
    assert got.sources == [None, path]
    with pytest.raises(vx.ImageLoadError, match="the path is empty"):
        vx.load_image("")
    with pytest.raises(vx.ImageLoadError, match="the path is empty"):
        ex.explain("", method="rollout")


def test_a_signed_caption_method_is_drawn_signed():
    """CaptionExplanation.figure() drew attnlrp's signed per-word relevance min-max on "jet" (the CLI draws it
    signed on "bwr"): a word's zero relevance took a mid-scale colour, as if it were evidence."""
    cap = vx.Explainer(vx.zoo.load("shapes-captioner"))
    images = vx.data.shapes(n=1, seed=16).images
    e = cap.explain_caption(images, method="attnlrp", max_len=3)
    assert e.signed and "signed=True" in repr(e)
    words = e.tokens[0]
    maps = e.maps[0, : len(words)]
    assert float(maps.min()) < 0 < float(maps.max())  # signed indeed
    want = vx.viz.caption_figure(images[0], words, maps, normalize="signed", colormap="bwr")
    np.testing.assert_array_equal(e.figure(0), want)
    plain = cap.explain_caption(images, method="cross", max_len=3)
    assert not plain.signed
    np.testing.assert_array_equal(plain.figure(0), vx.viz.caption_figure(images[0], plain.tokens[0],
                                                                          plain.maps[0, : len(plain.tokens[0])]))


def test_numpy_scalars_are_option_values(ex):
    """np.float32(0.9) for discard_ratio or np.int64(1) for start_layer (from NumPy arithmetic) were refused as
    'must be a number in [0, 1)' / 'an integer'."""
    x = vx.data.shapes(n=1, seed=17).tensor
    got = ex.explain(x, method="rollout", discard_ratio=np.float32(0.5), start_layer=np.int64(1))
    want = ex.explain(x, method="rollout", discard_ratio=float(np.float32(0.5)), start_layer=1)
    torch.testing.assert_close(got.maps, want.maps)
    assert got.options == {"discard_ratio": 0.5, "start_layer": 1} and type(got.options["start_layer"]) is int
    with pytest.raises(vx.OptionError, match="discard_ratio"):
        ex.explain(x, method="rollout", discard_ratio=np.float32(1.5))


def test_captions_given_as_words_or_nothing_say_what_to_pass():
    """A caption given as a list of words was called token ids 'outside the vocabulary'; None among the captions
    was a TypeError."""
    cap = vx.Explainer(vx.zoo.load("shapes-captioner"))
    x = vx.data.shapes(n=2, seed=18).tensor
    with pytest.raises(vx.UsageError, match=r"caption 0 is a list holding words \['red', 'circle'\]; pass its text "
                                            r"as one string \('red circle'\)"):
        cap.explain_caption(x, method="cross", caption=[["red", "circle"], ["blue", "star"]])
    with pytest.raises(vx.UsageError, match="caption 0 is NoneType"):
        cap.explain_caption(x, method="cross", caption=[None, "red"])
    got = cap.explain_caption(x, method="cross", caption=["red circle", "blue star"], layers=np.int64(-1))
    assert got.tokens == [["red", "circle"], ["blue", "star"]]


def test_a_caption_figure_on_the_original_image_puts_each_words_map_on_the_crop(wide):
    """figure(i, image=original) stretched each word's map of the centre crop over the whole photo, as
    Explanation.overlay did; each map is now placed on the crop box (vx.data.paste_map), the rest unseen."""
    cap = vx.Explainer(vx.zoo.load("shapes-captioner"))
    e = cap.explain_caption([wide], method="cross", max_len=3)
    assert (e.boxes[0].left, e.boxes[0].right) == (50.0, 250.0)
    words = e.tokens[0]
    fig = e.figure(0, image=wide, tile_size=None)
    pasted = np.stack([vx.data.paste_map(m, e.boxes[0]) for m in e.upsample()[0, : len(words)]])
    np.testing.assert_array_equal(fig, vx.viz.caption_figure(wide, words, pasted, tile_size=None))
    assert not np.array_equal(fig, vx.viz.caption_figure(wide, words, e.maps[0, : len(words)], tile_size=None))
    np.testing.assert_array_equal(e.figure(0), vx.viz.caption_figure(e.images[0], words, e.maps[0, : len(words)]))


def test_an_overlay_on_a_path_reads_the_image(ex, wide, tmp_path):
    """image='photo.png' was refused ('must be an (H, W, 3) uint8 RGB array, got str'), by e.overlay,
    vx.overlay and vx.viz.grid alike."""
    path = tmp_path / "wide photo.png"
    Image.fromarray(wide).save(path)
    e = ex.explain([str(path)], method="cdam")
    assert e.sources == [str(path)]
    np.testing.assert_array_equal(e.overlay(0, image=path), e.overlay(0, image=wide))
    np.testing.assert_array_equal(e.overlay(0, image=str(path)), e.overlay(0, image=wide))
    m = np.random.default_rng(19).random((3, 3))
    np.testing.assert_array_equal(vx.overlay(path, m), vx.overlay(wide, m))
    np.testing.assert_array_equal(vx.viz.grid([str(path), wide]), vx.viz.grid([wide, wide]))
    with pytest.raises(vx.ImageLoadError, match="no such file"):
        vx.overlay(tmp_path / "missing.png", m)


def test_the_matrix_of_a_caption_without_words_says_so():
    """A caption the model ended at once has no words: its matrix was 'expected a non-empty 2-D map, got (0, 64)'."""
    cap = vx.Explainer(vx.zoo.load("shapes-captioner"))
    e = cap.explain_caption(vx.data.shapes(n=2, seed=20).tensor, method="cross", max_len=2)
    e.tokens[1] = []  # as a caption ended at its first step leaves it
    with pytest.raises(vx.UsageError, match="caption 1 has no words"):
        vx.viz.caption_matrix(e, 1)
    assert vx.viz.caption_matrix(e, 0).ndim == 3


def test_normalize_none_is_not_the_string_none():
    """normalize=None was read as 'none' (values drawn as they are): a rollout map (values ~0.01) came out as one
    dark colour, where None reads as 'the default'."""
    with pytest.raises(vx.UsageError, match="normalize must be one of minmax, percentile, signed, none"):
        vx.overlay(_image(), np.full((2, 2), 0.01), normalize=None)
    np.testing.assert_array_equal(vx.overlay(_image(), np.full((2, 2), 0.5), normalize="NONE"),
                                  _blend(_image(), np.full(_image().shape[:2], 0.5), 0.5, "jet"))


def test_readable_takes_a_pil_image():
    """readable(PIL image) was an AttributeError (no .shape)."""
    small = _image(20, 30)
    np.testing.assert_array_equal(vx.viz.readable(Image.fromarray(small)), vx.viz.readable(small))
    assert vx.viz.readable(small).shape == (260, 390, 3)  # a whole factor, 13: the shortest side >= 256
