"""``vitexplain explore``: inputs like export, one page, clear errors, exit status."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from vitexplain.cli import main

SAMPLES = Path(__file__).resolve().parent.parent / "assets" / "samples"


def _images(page: Path) -> list[dict]:
    text = page.read_text()
    return json.loads(re.search(r'id="vx-data">(.*?)</script>', text, re.S).group(1))["images"]


@pytest.fixture()
def folder(tmp_path):
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    for i, path in enumerate(sorted(SAMPLES.glob("*.png"))[:3]):
        shutil.copy(path, (src / "sub" if i == 2 else src) / path.name)
    return src


def test_explore_writes_one_page_for_a_folder(folder, tmp_path, capsys) -> None:
    page = tmp_path / "out" / "page.html"
    code = main(["explore", str(folder), "--out", str(page), "--method", "generic,rollout", "--top-k", "2"])
    assert code == 0
    images = _images(page)
    assert [d["name"] for d in images] == ["01_blue_square.png", "02_green_triangle.png", "sub/03_green_cross_and_red_circle.png"]
    assert all([m["name"] for m in d["methods"]] == ["generic", "rollout"] for d in images)
    assert all(len(d["predictions"]) == 2 and d["attention"] for d in images)
    assert f"3 images, 0 failed -> {page}" in capsys.readouterr().err


def test_explore_leaves_out_unreadable_images_with_exit_1(folder, tmp_path, capsys) -> None:
    (folder / "broken.png").write_bytes(b"not a png")
    page = tmp_path / "p.html"
    assert main(["explore", str(folder), "--out", str(page), "--method", "rollout", "-q"]) == 1
    assert len(_images(page)) == 3
    assert "skipped" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("p.png", [], "--out must name the .html file"),
        ("p.html", ["--max-images", "2"], "more than --max-images 2"),
        ("p.html", ["--method", "cross"], "is for caption/vlm models"),
        ("p.html", ["--option", "rollout.head_fusion=median", "--method", "rollout"], "head_fusion"),
        ("p.html", ["--prompt", "what is in the image ?"], "is a vit model, which takes no prompt"),
    ],
)
def test_explore_usage_errors_exit_2(folder, tmp_path, capsys, name, args, message) -> None:
    assert main(["explore", str(folder), "--out", str(tmp_path / name), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / name).exists()


# ---------------------------------------------------------------------------------------------
# hostile inputs and outputs: one bad image or folder never costs the page; an unwritable --out
# is found before the work, a write failure at the end is reported cleanly (exit 74)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from batch_helpers import save_tiny

    return save_tiny(tmp_path_factory.mktemp("ckpt"))


def _explore(src, page, tiny, *extra) -> int:
    return main(["explore", str(src), "--out", str(page), "--model", tiny, "--method", "rollout", "-q", *extra])


def _no_model(monkeypatch) -> None:
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr("vitexplain.batch.explore.load_model", no_model)


def test_explore_skips_an_image_too_thin_to_crop_and_keeps_the_others(tiny, tmp_path, capsys) -> None:
    import numpy as np
    from PIL import Image

    from batch_helpers import images

    src = images(tmp_path / "in", ["a.png", "b.png"])
    Image.fromarray(np.full((1, 300_000, 3), 90, np.uint8)).save(src / "strip.png")
    page = tmp_path / "p.html"
    assert _explore(src, page, tiny) == 1
    assert [d["name"] for d in _images(page)] == ["a.png", "b.png"]
    err = capsys.readouterr().err
    assert "skipped" in err and "strip.png" in err and "aspect ratio" in err
    assert "--no-crop" in err  # the advice names a flag explore has

    # --no-crop resizes it whole: every image is on the page, exit 0
    assert _explore(src, page, tiny, "--no-crop") == 0
    assert [d["name"] for d in _images(page)] == ["a.png", "b.png", "strip.png"]


def _page_image(entry: dict):
    import base64
    import io

    import numpy as np
    from PIL import Image

    png = base64.b64decode(entry["image"].split(",", 1)[1])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_explore_no_crop_shows_and_explains_the_whole_image(tiny, tmp_path) -> None:
    """A 3:1 image in three bands, red | green | blue: the center crop sees only green; without
    cropping the image the page shows (the pixels the model saw) keeps all three, left to right."""
    import numpy as np
    from PIL import Image

    src = tmp_path / "in"
    src.mkdir()
    bands = np.zeros((40, 120, 3), np.uint8)
    bands[:, :40, 0] = bands[:, 40:80, 1] = bands[:, 80:, 2] = 255
    Image.fromarray(bands).save(src / "bands.png")
    page = tmp_path / "p.html"

    assert _explore(src, page, tiny) == 0
    cropped = _page_image(_images(page)[0])
    assert (cropped[:, :, 1] > 200).all() and (cropped[:, :, [0, 2]] < 60).all()  # all green

    assert _explore(src, page, tiny, "--no-crop") == 0
    (entry,) = _images(page)
    whole = _page_image(entry)
    h, w = whole.shape[:2]
    assert [h, w] == entry["size"]  # resized to the model's input, aspect ratio not kept
    for band, colour in enumerate((0, 1, 2)):  # the middle column of each band has its colour
        column = whole[:, (2 * band + 1) * w // 6]
        assert (column[:, colour] > 200).all() and (np.delete(column, colour, axis=1) < 60).all(), band


def test_the_explore_api_takes_crop_false(tmp_path) -> None:
    import numpy as np

    import vitexplain as vx
    from batch_helpers import save_tiny

    model = vx.zoo.load_checkpoint(save_tiny(tmp_path / "ckpt"))
    strip = np.full((1, 300_000, 3), 90, np.uint8)
    with pytest.raises(vx.InputError, match="--no-crop|crop=False"):
        vx.explore(model, [strip], tmp_path / "a.html", method="rollout")
    page = vx.explore(model, [strip], tmp_path / "b.html", method="rollout", crop=False)
    (entry,) = _images(page)
    assert (_page_image(entry) == 90).all()


def test_explore_reports_an_unreadable_folder_with_exit_1(tiny, tmp_path, monkeypatch, capsys) -> None:
    from batch_helpers import images, unreadable_folder

    src = images(tmp_path / "in", ["a.png", "locked/b.png"])
    locked = str(src / "locked")
    unreadable_folder(monkeypatch, locked)
    page = tmp_path / "p.html"
    assert _explore(src, page, tiny) == 1
    assert [d["name"] for d in _images(page)] == ["a.png"]
    err = capsys.readouterr().err
    assert f"cannot read folder {locked}" in err and "Permission denied" in err


@pytest.mark.parametrize("case", ["folder", "under a file", "read-only"])
def test_explore_refuses_an_unwritable_out_before_the_model_loads(case, tiny, tmp_path, monkeypatch, capsys) -> None:
    from batch_helpers import images, read_only_below

    src = images(tmp_path / "in", ["a.png"])
    if case == "folder":
        page = tmp_path / "page.html"
        page.mkdir()
        message = "is a folder"
    elif case == "under a file":
        (tmp_path / "file").write_text("x")
        page = tmp_path / "file" / "page.html"
        message = "is not a folder"
    else:
        page = tmp_path / "ro" / "page.html"
        page.parent.mkdir()
        read_only_below(monkeypatch, page.parent)
        message = "not writable: Read-only file system"
    _no_model(monkeypatch)
    assert _explore(src, page, tiny) == 2
    assert message in capsys.readouterr().err


def test_explore_reports_a_full_disk_at_the_end_with_exit_74(tiny, tmp_path, monkeypatch, capsys) -> None:
    import errno
    import os

    from batch_helpers import images

    src = images(tmp_path / "in", ["a.png"])
    page = tmp_path / "p.html"
    real_replace = os.replace

    def replace(src_, dst, *args, **kwargs):  # the page's rename fails: the disk is full
        if str(dst).endswith("p.html"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src_, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    assert _explore(src, page, tiny) == 74
    err = capsys.readouterr().err
    assert "No space left on device" in err and "Traceback" not in err
    assert not page.exists() and not list(tmp_path.glob(".*.tmp"))
