"""The batch commands against a hostile output folder, killed runs and signals (second round of
hostile runs): links planted in ``--out``, ``kill -9`` with DataLoader workers, signals while the
run finishes, folders named like the run's own files.

Offline and small: a 1-block ViT of the zoo architecture (random weights), 64 px images.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from batch_helpers import export, images, manifest, save_tiny, summary


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny(tmp_path_factory.mktemp("ckpt"))


def _victim(tmp_path: Path, name: str = "victim.txt") -> Path:
    victim = tmp_path / name
    victim.write_text("precious\n")
    return victim


# ---------------------------------------------------------------------------------------------
# links planted in --out never redirect a write
# ---------------------------------------------------------------------------------------------
def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(ckpt, tmp_path, capsys) -> None:
    src = images(tmp_path / "in", ["a.png"])
    out = tmp_path / "out"
    out.mkdir()
    victim = _victim(tmp_path)
    (out / ".vitexplain.lock").symlink_to(victim)
    assert export(src, out, ckpt) == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and ".vitexplain.lock" in err
    assert victim.read_text() == "precious\n"
    assert (out / ".vitexplain.lock").is_symlink()  # left for the user to look at


def test_a_hard_linked_lock_file_is_refused_and_its_target_untouched(ckpt, tmp_path, capsys) -> None:
    src = images(tmp_path / "in", ["a.png"])
    out = tmp_path / "out"
    out.mkdir()
    victim = _victim(tmp_path)
    os.link(victim, out / ".vitexplain.lock")
    assert export(src, out, ckpt) == 2
    assert "other names" in capsys.readouterr().err
    assert victim.read_text() == "precious\n"


def test_a_symlinked_subfolder_of_out_is_not_written_through(ckpt, tmp_path, capsys) -> None:
    src = images(tmp_path / "in", ["a.png", "sub/b.png", "sub/deeper/c.png"])
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "sub").symlink_to(elsewhere, target_is_directory=True)
    assert export(src, out, ckpt) == 1
    assert list(elsewhere.iterdir()) == []  # nothing written outside --out
    records = manifest(out)
    assert records["a.png"]["status"] == "ok"
    for key in ("sub/b.png", "sub/deeper/c.png"):
        assert records[key]["status"] == "failed", records[key]
        assert "symbolic link" in records[key]["error"] and "sub" in records[key]["error"]
    assert "symbolic link" in capsys.readouterr().err


def test_symlinked_manifest_summary_and_gallery_are_replaced_not_followed(ckpt, tmp_path) -> None:
    src = images(tmp_path / "in", ["a.png"])
    out = tmp_path / "out"
    out.mkdir()
    victims = {}
    for name in ("manifest.jsonl", "summary.json", "index.html"):
        victims[name] = _victim(tmp_path, f"victim-{name}")
        (out / name).symlink_to(victims[name])
    assert export(src, out, ckpt, "--html") == 0
    for name, victim in victims.items():
        assert victim.read_text() == "precious\n", name
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    assert manifest(out)["a.png"]["status"] == "ok" and summary(out)["status"] == "ok"
