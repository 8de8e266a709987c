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
