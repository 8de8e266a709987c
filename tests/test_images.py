"""Image loading (modes, EXIF, bad files) and preprocessing with crop bookkeeping."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

import vitexplain as vx
from vitexplain.data.images import (
    CropBox,
    ImageLoadError,
    crop_region,
    load_image,
    paste_map,
    preprocess,
    preprocess_kwargs,
)


def _save(path, im: Image.Image, **kw):
    im.save(path, **kw)
    return path


def _check_rgb(arr: np.ndarray, shape: tuple[int, int]) -> None:
    assert arr.dtype == np.uint8 and arr.shape == (*shape, 3) and arr.flags.c_contiguous


# ---------------------------------------------------------------------------- good files


def test_gray_8bit_png(tmp_path):
    g = np.arange(24, dtype=np.uint8).reshape(4, 6) * 10
    arr = load_image(_save(tmp_path / "g.png", Image.fromarray(g)))
    _check_rgb(arr, (4, 6))
    for c in range(3):
        np.testing.assert_array_equal(arr[..., c], g)


@pytest.mark.parametrize("ext", ["png", "tiff"])
def test_gray_16bit_keeps_high_byte(tmp_path, ext):
    v = np.array([[0, 255, 256, 1000], [32768, 65280, 65535, 257 * 77]], np.uint16)
    im = Image.fromarray(v)
    assert im.mode == "I;16"
    arr = load_image(_save(tmp_path / f"g16.{ext}", im))
    _check_rgb(arr, (2, 4))
    np.testing.assert_array_equal(arr[..., 0], [[0, 0, 1, 3], [128, 255, 255, 77]])
    np.testing.assert_array_equal(arr[..., 0], arr[..., 2])


def test_mode_I_and_F(tmp_path):
    arr = load_image(_save(tmp_path / "i.tiff", Image.fromarray(np.array([[0, 65535]], np.int32))))
    np.testing.assert_array_equal(arr[0, :, 0], [0, 255])
    f = Image.fromarray(np.array([[0.0, 0.5, 1.0]], np.float32))
    arr = load_image(_save(tmp_path / "f.tiff", f))
    np.testing.assert_array_equal(arr[0, :, 1], [0, 128, 255])


def test_rgba_and_la_composited_on_white(tmp_path):
    rgba = np.zeros((2, 3, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 0)  # fully transparent -> white
    rgba[0, 1] = (255, 0, 0, 255)  # opaque red
    rgba[0, 2] = (0, 0, 0, 128)  # half-transparent black -> mid gray
    arr = load_image(_save(tmp_path / "a.png", Image.fromarray(rgba, "RGBA")))
    _check_rgb(arr, (2, 3))
    np.testing.assert_array_equal(arr[0, 0], [255, 255, 255])
    np.testing.assert_array_equal(arr[0, 1], [255, 0, 0])
    np.testing.assert_array_equal(arr[0, 2], [127, 127, 127])
    la = Image.fromarray(np.array([[[50, 0], [50, 255]]], np.uint8), "LA")
    arr = load_image(_save(tmp_path / "la.png", la))
    np.testing.assert_array_equal(arr[0], [[255, 255, 255], [50, 50, 50]])


def test_palette_png_with_and_without_transparency(tmp_path):
    p = Image.new("P", (3, 1))
    p.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * (256 * 3 - 9))
    p.putdata([0, 1, 2])
    arr = load_image(_save(tmp_path / "p.png", p))
    np.testing.assert_array_equal(arr[0], [[255, 0, 0], [0, 255, 0], [0, 0, 255]])
    arr = load_image(_save(tmp_path / "pt.png", p, transparency=1))
    np.testing.assert_array_equal(arr[0], [[255, 0, 0], [255, 255, 255], [0, 0, 255]])
    arr = load_image(_save(tmp_path / "p.gif", p))
    np.testing.assert_array_equal(arr[0], [[255, 0, 0], [0, 255, 0], [0, 0, 255]])


def test_cmyk_jpeg(tmp_path):
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # red
    arr = load_image(_save(tmp_path / "c.jpg", cmyk, quality=95))
    _check_rgb(arr, (8, 8))
    assert arr[4, 4, 0] > 240 and arr[4, 4, 1] < 15 and arr[4, 4, 2] < 15


@pytest.mark.parametrize(
    "orientation, corner",
    [(1, (0, 0)), (6, (0, -1)), (8, (-1, 0)), (3, (-1, -1))],  # where the top-left marker ends up
)
def test_exif_orientation_applied(tmp_path, orientation, corner):
    a = np.zeros((20, 40, 3), np.uint8)
    a[..., 2] = 255  # blue
    a[:6, :6] = (255, 0, 0)  # red marker at the stored top-left
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = _save(tmp_path / f"o{orientation}.jpg", Image.fromarray(a), exif=exif, quality=95)
    arr = load_image(path)
    expected = (20, 40) if orientation in (1, 3) else (40, 20)
    _check_rgb(arr, expected)
    y = 2 if corner[0] == 0 else expected[0] - 3
    x = 2 if corner[1] == 0 else expected[1] - 3
    assert arr[y, x, 0] > 200 and arr[y, x, 2] < 60  # red marker here
    assert (arr[..., 0] > 200).sum() < 60  # and nowhere else


def test_sources_str_path_bytes_fileobj(tmp_path):
    a = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    path = _save(tmp_path / "x.png", Image.fromarray(a))
    data = path.read_bytes()
    for src in (path, str(path), data, bytearray(data), io.BytesIO(data)):
        np.testing.assert_array_equal(load_image(src), a)
    with open(path, "rb") as f:
        np.testing.assert_array_equal(load_image(f), a)
        assert not f.closed
    np.testing.assert_array_equal(vx.load_image(path), a)
    np.testing.assert_array_equal(vx.data.load_image(path), a)
    with pytest.raises(TypeError, match="expects a path .* got int"):
        load_image(123)  # type: ignore[arg-type]


def test_error_class_is_shared():
    import vitexplain.errors

    assert ImageLoadError is vitexplain.errors.ImageLoadError is vx.ImageLoadError
    assert vx.data.ImageLoadError is ImageLoadError
    assert issubclass(ImageLoadError, OSError) and issubclass(ImageLoadError, vx.VitexplainError)


# ----------------------------------------------------------------------------- bad files


def _noise_png(path, size=(64, 64)) -> bytes:
    a = np.random.default_rng(1).integers(0, 256, (*size, 3), dtype=np.uint8)
    Image.fromarray(a).save(path)
    return path.read_bytes()


def _noise_jpeg(size=(64, 64)) -> bytes:
    buf = io.BytesIO()
    a = np.random.default_rng(2).integers(0, 256, (*size, 3), dtype=np.uint8)
    Image.fromarray(a).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _bad_files(tmp_path):
    png = _noise_png(tmp_path / "good.png")
    jpg = _noise_jpeg()
    idat = bytearray(png)
    idat[200:260] = bytes(b ^ 0xFF for b in idat[200:260])  # header intact, pixel data broken
    files = {
        "corrupt_data.png": bytes(idat),
        "corrupt.png": png[:16] + bytes(np.random.default_rng(3).integers(0, 256, 4000, dtype=np.uint8)),
        "random.jpg": bytes(np.random.default_rng(4).integers(0, 256, 2000, dtype=np.uint8)),
        "truncated.png": png[: len(png) // 2],
        "truncated.jpg": jpg[: len(jpg) // 2],
        "empty.png": b"",
        "notes.png": b"this is a text file, not an image\n" * 20,
    }
    paths = {}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        paths[name] = tmp_path / name
    (tmp_path / "a folder.png").mkdir()
    paths["dir"] = tmp_path / "a folder.png"
    paths["missing"] = tmp_path / "missing.png"
    return paths


def test_every_bad_file_kind_raises_with_path_and_reason(tmp_path):
    paths = _bad_files(tmp_path)
    before = {k: p.read_bytes() for k, p in paths.items() if p.is_file()}
    reasons = {
        "truncated.png": "truncated|corrupt",
        "truncated.jpg": "truncated",
        "empty.png": "empty",
        "notes.png": "not a recognised image",
        "random.jpg": "not a recognised image",
        "corrupt.png": "header is corrupt",
        "corrupt_data.png": "corrupt",
        "dir": "directory",
        "missing": "no such file",
    }
    for key, path in paths.items():
        with pytest.raises(ImageLoadError, match=reasons[key]) as info:
            load_image(path)
        assert str(path) in str(info.value), key
        assert isinstance(info.value, OSError)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False  # never silently half-decoded
    for key, data in before.items():
        assert paths[key].read_bytes() == data  # inputs byte-identical


def test_truncated_bytes_and_fileobj_named(tmp_path):
    jpg = _noise_jpeg()
    with pytest.raises(ImageLoadError, match="bytes in memory"):
        load_image(jpg[: len(jpg) // 3])
    p = tmp_path / "t.jpg"
    p.write_bytes(jpg[: len(jpg) // 3])
    with open(p, "rb") as f, pytest.raises(ImageLoadError, match="t.jpg"):
        load_image(f)


def test_decompression_bomb_refused(tmp_path, monkeypatch):
    path = _save(tmp_path / "big.png", Image.new("RGB", (40, 30)))
    before = path.read_bytes()
    with pytest.raises(ImageLoadError, match="max_pixels") as info:
        load_image(path, max_pixels=1000)
    assert "40x30" in str(info.value) and str(path) in str(info.value)
    assert load_image(path, max_pixels=1200).shape == (30, 40, 3)
    # Pillow's own limit still applies (and is explained) when max_pixels is lifted
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageLoadError, match="MAX_IMAGE_PIXELS"):
        load_image(path, max_pixels=None)
    assert path.read_bytes() == before


# ---------------------------------------------------------------------------- preprocess


@pytest.fixture(scope="module")
def vit_model():
    import timm
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, depth=1)
    return model


@pytest.mark.parametrize("shape", [(300, 451), (480, 200), (224, 224), (120, 90)])
def test_preprocess_matches_timm_eval_transform(vit_model, shape):
    from timm.data import create_transform, resolve_data_config

    cfg = resolve_data_config(model=vit_model)
    ref_t = create_transform(**cfg)
    img = np.random.default_rng(5).integers(0, 256, (*shape, 3), dtype=np.uint8)
    x, boxes = preprocess([img, img[:, ::-1]], **preprocess_kwargs(vit_model))
    assert x.shape == (2, 3, 224, 224) and x.dtype == torch.float32
    ref = ref_t(Image.fromarray(img))
    assert (x[0] - ref).abs().max().item() < 1e-5
    assert (x[1] - ref_t(Image.fromarray(np.ascontiguousarray(img[:, ::-1])))).abs().max().item() < 1e-5
    assert boxes[0].image_size == shape


@pytest.mark.parametrize(
    "size, crop_pct, interp", [((160, 256), 0.875, "bilinear"), ((224, 224), 1.15, "bicubic"), ((224, 224), 1.0, "bicubic")]
)
def test_preprocess_matches_timm_other_configs(size, crop_pct, interp):
    from timm.data import create_transform

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    ref_t = create_transform(input_size=(3, *size), crop_pct=crop_pct, interpolation=interp, mean=mean, std=std)
    img = np.random.default_rng(6).integers(0, 256, (300, 451, 3), dtype=np.uint8)
    x, (box,) = preprocess(img, input_size=size, mean=mean, std=std, crop_pct=crop_pct, interpolation=interp)
    assert (x[0] - ref_t(Image.fromarray(img))).abs().max().item() < 1e-5
    if crop_pct > 1:  # crop larger than the resized image: zero padding, box extends past the image
        assert box.top < 0 and box.bottom > 300


def test_preprocess_no_crop_resizes_whole_image():
    from torchvision import transforms as T

    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    img = np.random.default_rng(7).integers(0, 256, (90, 130, 3), dtype=np.uint8)
    x, (box,) = preprocess(img, input_size=(3, 64, 48), mean=mean, std=std, crop=False, interpolation="bilinear")
    ref = T.Compose([T.Resize((64, 48), T.InterpolationMode.BILINEAR), T.ToTensor(), T.Normalize(mean, std)])
    assert (x[0] - ref(Image.fromarray(img))).abs().max().item() < 1e-5
    assert box == CropBox(0.0, 0.0, 130.0, 90.0, (90, 130))
    np.testing.assert_array_equal(crop_region(img, box), img)


def test_crop_box_maps_back_on_non_square_image():
    h0, w0 = 300, 451
    yy, xx = np.mgrid[0:h0, 0:w0]
    img = np.stack([xx * 255 // (w0 - 1), yy * 255 // (h0 - 1), np.full_like(xx, 128)], -1).astype(np.uint8)
    x, (box,) = preprocess(img, input_size=(224, 224), mean=(0, 0, 0), std=(1, 1, 1), crop_pct=0.875)
    # analytic: shorter side 300 -> floor(224 / 0.875) = 256, width int(256 * 451 / 300) = 384
    s = 300 / 256
    assert box.top == pytest.approx(16 * s) and box.bottom == pytest.approx(240 * s)
    assert box.left == pytest.approx(80 * 451 / 384) and box.right == pytest.approx(304 * 451 / 384)
    region = crop_region(img, box)
    l, t, r, b = box.to_int()
    assert region.shape == (b - t, r - l, 3)
    # the region, resized to the model input, is what the model saw (smooth ramp image)
    seen = (x[0].permute(1, 2, 0).numpy() * 255).round()
    resized = np.asarray(Image.fromarray(region).resize((224, 224), Image.BICUBIC), dtype=np.float64)
    assert np.abs(seen - resized)[4:-4, 4:-4].max() <= 2.0


def test_paste_map_places_map_on_the_box():
    box = CropBox(10.0, 5.0, 50.0, 25.0, (30, 60))  # 40 x 20 region in a 60 x 30 image
    full = paste_map(torch.ones(4, 4), box, fill=0.0)
    assert full.shape == (30, 60) and full.dtype == np.float32
    assert (full[5:25, 10:50] == 1).all() and full.sum() == 40 * 20
    # nearest: each map cell covers its share of the box
    quad = paste_map(np.array([[1.0, 2.0], [3.0, 4.0]]), box, interpolation="nearest", fill=-1)
    assert quad[5, 10] == 1 and quad[5, 49] == 2 and quad[24, 10] == 3 and quad[24, 49] == 4
    assert quad[14, 29] == 1 and quad[15, 30] == 4 and quad[0, 0] == -1
    # default fill = map minimum; bilinear inside matches resizing the map onto the region
    ramp = np.linspace(0, 1, 8, dtype=np.float32).reshape(2, 4)
    full = paste_map(ramp, box)
    assert full[0, 0] == 0.0
    import cv2

    np.testing.assert_allclose(full[5:25, 10:50], cv2.resize(ramp, (40, 20), interpolation=cv2.INTER_LINEAR), atol=1e-5)
    # the pasted map overlays the full image
    out = vx.overlay(np.zeros((30, 60, 3), np.uint8), full)
    assert out.shape == (30, 60, 3)


def test_preprocess_bad_arguments():
    img = np.zeros((10, 10, 3), np.uint8)
    kw = dict(input_size=(8, 8), mean=(0, 0, 0), std=(1, 1, 1))
    with pytest.raises(ValueError, match="interpolation"):
        preprocess(img, interpolation="cubic9", **kw)
    with pytest.raises(ValueError, match="uint8"):
        preprocess(img.astype(np.float32), **kw)
    with pytest.raises(ValueError, match="crop_pct"):
        preprocess(img, crop_pct=0, **kw)
    assert math.isclose(preprocess(img, crop_pct=None, **kw)[1][0].width, 10.0)


def test_pil_inputs_use_the_same_conversion():
    rgba = Image.new("RGBA", (6, 4), (255, 0, 0, 0))  # fully transparent red -> white
    x, _ = preprocess(rgba, input_size=(4, 6), mean=(0, 0, 0), std=(1, 1, 1), crop=False)
    assert torch.allclose(x, torch.ones_like(x))


# VmHWM: this process's peak resident memory since exec (ru_maxrss would start from the RSS
# of the parent that forked it -- the test process, with torch loaded)
_PEAK = """
import json, sys
from vitexplain.data.images import load_image
def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
before = peak()
out = load_image(sys.argv[1])
print(json.dumps({"grew": peak() - before, "result": out.nbytes, "shape": list(out.shape)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("kind", ["rgba16", "gray16", "rgb8"])
def test_decoding_needs_at_most_about_the_decoded_image_plus_the_result(tmp_path, kind):
    """The peak memory of load_image (the whole process: Pillow's and numpy's) in a fresh
    interpreter, as a multiple of the result's size, on a 6 MP image.

    The floor is Pillow's decoded image (4 bytes per pixel for RGBA and RGB, 2 for I;16) plus
    the uint8 RGB result (3): 2.33x for RGBA and RGB. Measured 2.84x (16-bit RGBA), 1.98x
    (16-bit gray) and 2.65x (8-bit RGB), the rest being one strip's temporaries; before the
    conversion went strip by strip, 7.92x, 3.46x and 4.79x (a 96 MP 16-bit RGBA PNG: 1.92 GB
    for a 288 MB result, now 0.68 GB). Bound: the largest measured ratio + 0.36 (6.5 MB here).
    """
    import cv2

    h, w = 2000, 3000
    y, x = np.linspace(0, 1, h)[:, None], np.linspace(0, 1, w)[None, :]
    g16 = ((y + x) / 2 * 65535).astype(np.uint16)
    bgra16 = np.stack([g16, np.broadcast_to(y * 65535, (h, w)).astype(np.uint16),
                       np.broadcast_to(x * 65535, (h, w)).astype(np.uint16), 65535 - g16 // 4], -1)
    image = {"rgba16": bgra16, "gray16": g16, "rgb8": (bgra16[..., :3] >> 8).astype(np.uint8)}[kind]
    path = tmp_path / f"{kind}.png"
    assert cv2.imwrite(str(path), image)
    root = str(Path(vx.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, env=env,
                          check=True)
    got = json.loads(done.stdout)
    assert got["shape"] == [h, w, 3]
    assert got["grew"] <= 3.2 * got["result"], got["grew"] / got["result"]


def test_as_rgb_converts_an_opened_image_as_its_file(tmp_path):
    """``as_rgb`` (what explain, explain_caption and explore do with a PIL image) gives the pixels
    ``load_image`` gives for the same file: alpha on white, a 16-bit image's high byte."""
    from vitexplain.data.arrays import as_rgb

    rgba = np.zeros((2, 3, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 0)  # fully transparent: white, not its hidden colour
    rgba[1, 2] = (0, 0, 0, 128)
    gray16 = np.array([[0, 256, 1000], [32768, 65535, 257 * 77]], np.uint16)
    for name, im, first in [("a.png", Image.fromarray(rgba, "RGBA"), [255, 255, 255]),
                            ("g16.png", Image.fromarray(gray16), [0, 0, 0])]:
        path = _save(tmp_path / name, im)
        with Image.open(path) as opened:
            arr = as_rgb(opened)
        np.testing.assert_array_equal(arr, load_image(path))
        np.testing.assert_array_equal(arr[0, 0], first)
    np.testing.assert_array_equal(arr[..., 1], [[0, 1, 3], [128, 255, 77]])  # the high byte, not 255 everywhere


@pytest.mark.parametrize("name, array", [
    ("i32.tiff", np.array([[0, 100, 7], [200, 255, 1]], np.int32)),  # Pillow mode 'I' (32-bit signed)
    ("i16.tiff", np.array([[0, 100, 7], [200, 255, 1]], np.uint16)),  # mode 'I;16'
    ("i16.png", np.array([[0, 100, 7], [200, 255, 1]], np.uint16)),
])
def test_integer_gray_holding_8bit_values_is_read_as_8bit(tmp_path, name, array):
    """A 16- or 32-bit gray file whose values all lie in 0..255 holds 8-bit data (what Pillow's own
    ``convert("I")`` / ``convert("I;16")`` of an 8-bit image gives): its pixels are those values, not the
    high byte, which made every such image load black."""
    arr = load_image(_save(tmp_path / name, Image.fromarray(array)))
    _check_rgb(arr, (2, 3))
    for c in range(3):
        np.testing.assert_array_equal(arr[..., c], [[0, 100, 7], [200, 255, 1]])


def test_integer_gray_rule_at_the_8bit_boundary(tmp_path):
    """One value past 255 makes the file 16-bit data (high byte); past 65535 (32-bit 'I') min-max stretched;
    an 8-bit image converted by Pillow to 'I' / 'I;16' gives its own gray levels."""
    arr = load_image(_save(tmp_path / "b.tiff", Image.fromarray(np.array([[0, 255, 256, 65535]], np.uint16))))
    np.testing.assert_array_equal(arr[0, :, 0], [0, 0, 1, 255])
    arr = load_image(_save(tmp_path / "s.tiff", Image.fromarray(np.array([[0, 100, 70000]], np.int32))))
    np.testing.assert_array_equal(arr[0, :, 0], [0, round(100 * 255 / 70000), 255])
    from vitexplain.data.arrays import as_rgb

    gray = np.array([[3, 50], [128, 255]], np.uint8)
    for mode in ("I", "I;16"):
        np.testing.assert_array_equal(as_rgb(Image.fromarray(gray).convert(mode))[..., 1], gray)
