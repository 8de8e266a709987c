"""Overlays, colormaps, grids and PNG writing: colours checked at known pixels, RGB order."""

from __future__ import annotations

import os
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

import vitexplain as vx
from vitexplain.viz import apply_colormap, colormap_lut, colormap_names, grid, normalize_map, overlay, save_png


def _cv_rgb(value: int, cmap: int) -> np.ndarray:
    """Oracle: OpenCV's own colour for a uint8 value, converted BGR -> RGB."""
    return cv2.applyColorMap(np.array([[value]], np.uint8), cmap)[0, 0, ::-1]


def _halves(h: int = 20, w: int = 30) -> tuple[np.ndarray, np.ndarray]:
    image = np.full((h, w, 3), 90, np.uint8)
    m = np.zeros((4, 6), np.float32)
    m[:, :3] = 1.0  # 1 on the left half, 0 on the right
    return image, m


def test_known_map_gives_known_colours_jet_alpha1():
    image, m = _halves()
    out = overlay(image, m, alpha=1.0, colormap="jet", interpolation="nearest")
    assert out.shape == image.shape and out.dtype == np.uint8
    jet1, jet0 = _cv_rgb(255, cv2.COLORMAP_JET), _cv_rgb(0, cv2.COLORMAP_JET)
    assert (out[:, :15] == jet1).all() and (out[:, 15:] == jet0).all()
    assert jet1[0] > jet1[2]  # dark red in RGB
    assert jet0[2] > jet0[0]  # dark blue in RGB
    np.testing.assert_array_equal(out[5, 2], [128, 0, 0])
    np.testing.assert_array_equal(out[5, 27], [0, 0, 128])


def test_alpha_zero_returns_image_and_input_untouched():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (12, 17, 3), dtype=np.uint8)
    before = image.copy()
    out = overlay(image, rng.random((3, 3)), alpha=0.0)
    np.testing.assert_array_equal(out, image)
    np.testing.assert_array_equal(image, before)
    assert out is not image


def test_blend_formula_and_rgb_order():
    red = np.zeros((8, 8, 3), np.uint8)
    red[..., 0] = 255
    # alpha 0: a red image stays red (no BGR swap anywhere)
    np.testing.assert_array_equal(overlay(red, np.ones((2, 2)), alpha=0.0)[3, 3], [255, 0, 0])
    # zero map -> jet(0) = (0, 0, 128) RGB; half blend with red -> R dominant, B from the map
    out = overlay(red, np.zeros((2, 2)), alpha=0.5, colormap="jet")
    np.testing.assert_array_equal(out[3, 3], [128, 0, 64])


def test_signed_zero_is_transparent_by_default():
    image = np.full((10, 40, 3), 90, np.uint8)
    m = np.array([[-2.0, 0.0, 0.5, 1.0]])  # negative, zero, a quarter of max|m|, half of it
    out = overlay(image, m, alpha=0.8, normalize="signed", interpolation="nearest").astype(int)
    np.testing.assert_array_equal(out[5, 15], [90, 90, 90])  # zero: the image as it is
    np.testing.assert_array_equal(out[5, 5], np.rint(0.2 * 90 + 0.8 * np.array([0, 0, 255])))  # -max: full alpha blue
    # +max/4: normalised 0.625 -> bwr[159] = (255, 192, 192), at weight 0.8 * min(1, 2 * 0.25) = 0.4
    np.testing.assert_array_equal(out[5, 25], np.rint(0.6 * 90 + 0.4 * np.array([255, 192, 192])))
    assert out[5, 35, 0] == round(0.2 * 90 + 0.8 * 255)  # from max/2 on: full alpha
    # the opaque blend of the diverging map, as before, on request
    opaque = overlay(image, m, alpha=1.0, normalize="signed", interpolation="nearest", transparent_zero=False)
    assert (opaque[5, 15] >= 250).all()


def test_signed_zero_is_colormap_centre_and_sign_side():
    image = np.zeros((10, 30, 3), np.uint8)
    m = np.array([[-2.0, 0.0, 1.0]])  # left negative, middle zero, right positive
    out = overlay(image, m, alpha=1.0, normalize="signed", interpolation="nearest", transparent_zero=False)  # bwr
    left, mid, right = out[5, 5].astype(int), out[5, 15].astype(int), out[5, 25].astype(int)
    assert (mid >= 250).all()  # white-ish centre
    np.testing.assert_array_equal(left, [0, 0, 255])  # -max|m| -> full blue
    assert right[0] == 255 and right[2] < 160  # +1 of max 2 -> half-way to red
    # coolwarm: light-gray centre, blue negative, red positive
    out = overlay(image, m, alpha=1.0, normalize="signed", colormap="coolwarm", interpolation="nearest", transparent_zero=False)
    c = out[5, 15].astype(int)
    assert c.min() > 200 and c.max() - c.min() < 8
    assert out[5, 5, 2] > out[5, 5, 0] and out[5, 25, 0] > out[5, 25, 2]


def test_normalize_modes():
    m = np.arange(100, dtype=np.float64).reshape(10, 10)
    mm = normalize_map(m, "minmax")
    assert mm.dtype == np.float32 and mm.min() == 0.0 and mm.max() == 1.0
    hot = np.arange(2500, dtype=np.float64).reshape(50, 50)
    hot[0, 0] = 1e6  # one hot pixel
    assert np.median(normalize_map(hot, "minmax")) < 0.01
    p = normalize_map(hot, "percentile")
    assert 0.4 < np.median(p) < 0.6 and p.max() == 1.0 and p.min() == 0.0
    s = normalize_map(np.array([[-1.0, 0.0, 0.5]]), "signed")
    np.testing.assert_allclose(s, [[0.0, 0.5, 0.75]])
    np.testing.assert_allclose(normalize_map(np.array([[0.2, 0.7]]), "none"), [[0.2, 0.7]], rtol=1e-6)
    with pytest.raises(ValueError, match="none"):
        normalize_map(np.array([[0.0, 2.0]]), "none")
    with pytest.raises(ValueError, match="minmax"):
        normalize_map(m, "zscore")


@pytest.mark.parametrize("mode", ["minmax", "percentile", "signed", "none"])
@pytest.mark.parametrize("value", [0.0, 0.3])
def test_constant_map_is_flat(mode, value):
    image = np.full((9, 11, 3), 40, np.uint8)
    out = overlay(image, np.full((3, 4), value), normalize=mode, alpha=0.7)
    assert out.dtype == np.uint8
    assert (out == out[0, 0]).all()
    assert np.isfinite(normalize_map(np.full((3, 4), value), mode)).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_map_raises(bad):
    m = np.ones((4, 4))
    m[1, 2] = bad
    with pytest.raises(ValueError, match="NaN/inf"):
        overlay(np.zeros((8, 8, 3), np.uint8), m)
    with pytest.raises(ValueError, match="NaN/inf"):
        overlay(np.zeros((8, 8, 3), np.uint8), torch.from_numpy(m))


@pytest.mark.parametrize("interp", ["nearest", "bilinear", "bicubic"])
@pytest.mark.parametrize("map_shape", [(3, 5), (14, 14), (60, 90)])
def test_map_resized_to_non_square_image(interp, map_shape):
    image = np.zeros((17, 40, 3), np.uint8)
    m = np.random.default_rng(1).random(map_shape)
    out = overlay(image, m, interpolation=interp, contour=True)
    assert out.shape == (17, 40, 3) and out.dtype == np.uint8


def test_nearest_interpolation_places_cells_exactly():
    image = np.zeros((4, 6, 3), np.uint8)
    m = np.array([[0.0, 1.0]])
    out = overlay(image, m, alpha=1.0, interpolation="nearest")
    assert (out[:, :3] == _cv_rgb(0, cv2.COLORMAP_JET)).all()
    assert (out[:, 3:] == _cv_rgb(255, cv2.COLORMAP_JET)).all()


def test_torch_input_matches_numpy():
    image = np.random.default_rng(2).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    m = torch.rand(7, 7, requires_grad=True) * 3 - 1
    ref = overlay(image, m.detach().numpy())
    np.testing.assert_array_equal(overlay(image, m), ref)
    np.testing.assert_array_equal(overlay(image, m.detach()[None]), ref)  # (1, h, w) squeezed
    out_bf16 = overlay(image, m.detach().to(torch.bfloat16))
    assert out_bf16.shape == image.shape
    np.testing.assert_array_equal(vx.overlay(image, m), ref)


def test_colormaps_by_name_match_opencv_in_rgb():
    cv_names = [n for n in dir(cv2) if n.startswith("COLORMAP_")]
    assert cv_names
    ramp = np.arange(256, dtype=np.float32).reshape(16, 16) / 255.0
    for n in cv_names:
        name = n[len("COLORMAP_"):]
        expected = cv2.applyColorMap(np.arange(256, dtype=np.uint8).reshape(16, 16), getattr(cv2, n))[..., ::-1]
        np.testing.assert_array_equal(apply_colormap(ramp, name.lower()), expected, err_msg=name)
        np.testing.assert_array_equal(colormap_lut(name), colormap_lut(name.lower()))  # case-insensitive
    assert {"jet", "viridis", "inferno", "turbo", "bwr", "coolwarm"} <= set(colormap_names())
    np.testing.assert_array_equal(colormap_lut("Jet_r"), colormap_lut("jet")[::-1])


def test_unknown_colormap_lists_choices():
    with pytest.raises(ValueError, match="viridis"):
        overlay(np.zeros((4, 4, 3), np.uint8), np.ones((2, 2)), colormap="no-such-map")


def test_bad_arguments():
    m = np.ones((2, 2))
    with pytest.raises(ValueError, match="uint8"):
        overlay(np.zeros((4, 4, 3), np.float32), m)
    with pytest.raises(ValueError, match="RGB"):
        overlay(np.zeros((4, 4), np.uint8), m)
    with pytest.raises(ValueError, match="alpha"):
        overlay(np.zeros((4, 4, 3), np.uint8), m, alpha=1.5)
    with pytest.raises(ValueError, match="interpolation"):
        overlay(np.zeros((4, 4, 3), np.uint8), m, interpolation="lanczos9")
    with pytest.raises(ValueError, match="2-D"):
        overlay(np.zeros((4, 4, 3), np.uint8), np.ones((2, 2, 2)))


def test_contour_drawn_on_the_iso_line_only():
    image, m = _halves(40, 60)
    plain = overlay(image, m, alpha=1.0, interpolation="nearest")
    lined = overlay(image, m, alpha=1.0, interpolation="nearest", contour=True)
    changed = np.argwhere((plain != lined).any(axis=2))
    assert len(changed) > 0
    # only the iso-line at the left/right boundary (x = 30), not the image frame
    assert np.all(np.abs(changed[:, 1] - 29.5) < 4)
    assert changed[:, 0].min() == 0 and changed[:, 0].max() == 39  # spans the full height
    assert (lined == 255).all(axis=2).any()  # white line present


def test_viz_import_is_lazy_and_names_stay_callable():
    code = (
        "import sys, numpy as np\n"
        "import vitexplain, vitexplain.viz\n"
        "assert 'cv2' not in sys.modules, 'import vitexplain.viz pulled in cv2'\n"
        "from vitexplain.viz.overlays import overlay\n"  # binds the submodule on the package
        "from vitexplain.viz.grids import grid\n"
        "img = np.zeros((4, 4, 3), np.uint8)\n"
        "ref = overlay(img, np.eye(2))\n"
        "assert (vitexplain.viz.overlay(img, np.eye(2)) == ref).all()\n"
        "assert (vitexplain.overlay(img, np.eye(2)) == ref).all()\n"
        "assert vitexplain.viz.grid([[img, img]]).shape[2] == 3\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def _solid(h: int, w: int, rgb: tuple[int, int, int]) -> np.ndarray:
    return np.broadcast_to(np.array(rgb, np.uint8), (h, w, 3)).copy()


def test_grid_layout_labels_and_resizing():
    red, green = _solid(20, 30, (255, 0, 0)), _solid(40, 60, (0, 255, 0))  # same aspect, 2x size
    tall = _solid(30, 10, (0, 0, 255))
    fig = grid([[red, green, tall], [green, None]], pad=4, row_labels=["img a", "img b"],
               col_labels=["input", "rollout", "cdam"])
    assert fig.dtype == np.uint8 and fig.ndim == 3
    no_labels = grid([[red, green, tall], [green, None]], pad=4)
    assert no_labels.shape == (4 + 2 * (20 + 4), 4 + 3 * (30 + 4), 3)
    assert fig.shape[0] > no_labels.shape[0] and fig.shape[1] > no_labels.shape[1]
    # unlabelled: cell centres have the right colours (RGB preserved), empty cell is background
    cy = lambda r: 4 + r * 24 + 10  # noqa: E731
    cx = lambda c: 4 + c * 34 + 15  # noqa: E731
    np.testing.assert_array_equal(no_labels[cy(0), cx(0)], [255, 0, 0])
    np.testing.assert_array_equal(no_labels[cy(0), cx(1)], [0, 255, 0])  # 40x60 shrunk into 20x30
    np.testing.assert_array_equal(no_labels[cy(0), cx(2)], [0, 0, 255])  # letterboxed tall tile
    np.testing.assert_array_equal(no_labels[cy(0), cx(2) - 12], [255, 255, 255])
    np.testing.assert_array_equal(no_labels[cy(1), cx(1)], [255, 255, 255])  # None cell
    assert (fig < 128).all(axis=2).any()  # dark label text drawn
    with pytest.raises(ValueError, match="column labels"):
        grid([[red, red]], col_labels=["one"])
    with pytest.raises(ValueError, match="at least one"):
        grid([[None]])
    assert grid([red, red], tile_size=(10, 15), pad=0).shape == (10, 30, 3)  # flat list = one row


def test_save_png_roundtrip_rgb_atomic(tmp_path):
    rgb = np.zeros((5, 7, 3), np.uint8)
    rgb[..., 0] = 200
    rgb[2, 3] = (1, 2, 3)
    dest = tmp_path / "sub dir" / "out é.png"
    assert save_png(dest, rgb) == dest
    back = np.asarray(Image.open(dest).convert("RGB"))
    np.testing.assert_array_equal(back, rgb)
    save_png(dest, rgb[::-1])  # overwrite in place
    np.testing.assert_array_equal(np.asarray(Image.open(dest).convert("RGB")), rgb[::-1])
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]  # no temp files left
    with pytest.raises(ValueError, match=r"uint8 RGB array, got shape \(4, 4, 3\) dtype float32"):
        save_png(tmp_path / "bad.png", np.zeros((4, 4, 3), np.float32))
    assert not (tmp_path / "bad.png").exists()
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4)
    save_png(tmp_path / "g.png", gray)
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "g.png")), gray)


def test_tiny_magnitude_maps_are_not_flattened():
    image = np.zeros((8, 8, 3), np.uint8)
    m = np.random.default_rng(3).random((4, 4))
    for mode in ("minmax", "percentile", "signed"):
        np.testing.assert_array_equal(overlay(image, m * 1e-20, normalize=mode), overlay(image, m, normalize=mode))
    noisy = np.float32(1.0) + np.float32(1e-7) * np.random.default_rng(4).random((4, 4)).astype(np.float32)
    assert (normalize_map(noisy) == 0).all()  # float32 rounding noise around a constant: flat


def test_readable_enlarges_small_images_by_a_whole_factor():
    from vitexplain.viz import readable

    small = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    big = readable(small, 5)  # shortest side 2 -> factor 3
    assert big.shape == (6, 9, 3)
    np.testing.assert_array_equal(big[::3, ::3], small)  # each pixel a 3x3 block
    np.testing.assert_array_equal(big[2, 5], small[0, 1])
    image = np.zeros((300, 400, 3), np.uint8)
    assert readable(image) is image  # already >= 256 px
    photo = np.full((224, 300, 3), 7, np.uint8)  # more than half the size: smoothly to exactly 256, not doubled
    enlarged = readable(photo)
    assert enlarged.shape == (256, 343, 3) and (enlarged == 7).all()
    assert readable(np.zeros((64, 64, 3), np.uint8)).shape == (256, 256, 3)  # 64 px: a whole factor, 4


def test_cells_that_reach_past_a_padded_input_are_placed_on_their_pixels():
    """A ViT that pads its input up to whole patches (timm dynamic_img_pad) reads a 50 x 70 input as a 4 x 5 grid
    over 64 x 80 pixels: upsample and overlay put each cell on its own 16 x 16 pixels and crop the padding, instead
    of stretching the grid over the input (which shifts the last column by up to 14 px)."""
    import numpy as np
    import timm
    import torch

    import vitexplain as vx

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=3, dynamic_img_size=True,
                              dynamic_img_pad=True).eval()
    e = vx.Explainer(model).explain(torch.rand(1, 3, 50, 70), method="cdam", target=1)
    assert e.maps.shape == (1, 4, 5) and e.layout.patch_size == (16, 16)
    cells = e.maps[0].repeat_interleave(16, 0).repeat_interleave(16, 1)  # (64, 80): each cell on its pixels
    assert torch.equal(e.upsample(mode="nearest")[0], cells[:50, :70])
    assert torch.equal(e.upsample((100, 140), mode="nearest")[0],
                       e.maps[0].repeat_interleave(32, 0).repeat_interleave(32, 1)[:100, :140])
    e.maps = torch.zeros_like(e.maps)
    e.maps[0, :, -1] = 1.0  # only the last column of cells: pixels 64..69 of the input
    image = np.full((50, 70, 3), 128, np.uint8)
    drawn = e.overlay(0, image=image, interpolation="nearest", normalize="minmax")
    assert drawn.shape == (50, 70, 3)
    assert (drawn[:, :64] == drawn[0, 0]).all() and (drawn[:, 64:] != drawn[0, 0]).any(axis=-1).all()
