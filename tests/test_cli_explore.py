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
        ("p.html", ["--method", "cross"], "is for caption models"),
        ("p.html", ["--option", "rollout.head_fusion=median", "--method", "rollout"], "head_fusion"),
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
    assert "--no-crop" not in err  # explore has no such flag


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
