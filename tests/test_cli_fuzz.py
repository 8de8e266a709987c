"""The batch commands fuzzed with careless option values (third round of hostile runs): worker
counts past the work or the machine, an enlargement past the overlay's size bound, an empty
--out.

Offline and small: a 1-block ViT of the zoo architecture (random weights), 64 px images.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from batch_helpers import export, images, manifest, save_tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny(tmp_path_factory.mktemp("ckpt"))


def test_more_workers_than_batches_start_only_the_workers_there_is_work_for(ckpt, tmp_path, monkeypatch) -> None:
    # --workers 64 with 2 images in batches of 1: a DataLoader of 64 processes, 62 of them idle
    # (--workers 100000 forked for minutes before the first image).
    from vitexplain.batch import shard

    started = []
    real = shard.make_loader

    def make_loader(dataset, *, batch_size, workers, pin_memory):
        started.append(workers)
        return real(dataset, batch_size=batch_size, workers=0, pin_memory=pin_memory)

    monkeypatch.setattr(shard, "make_loader", make_loader)
    src = images(tmp_path / "in", ["a.png", "b.png"])
    assert export(src, tmp_path / "out", ckpt, "-j", "64", "-b", "1") == 0
    assert started == [2]  # one worker per batch to decode
    assert export(src, tmp_path / "out2", ckpt, "-j", "64", "-b", "8") == 0
    assert started == [2, 1]
    assert len(manifest(tmp_path / "out2")) == 2


def test_a_worker_count_far_past_the_machine_is_a_usage_error(ckpt, tmp_path, capsys) -> None:
    src = images(tmp_path / "in", [f"{i}.png" for i in range(3)])
    limit = max(64, 8 * (os.cpu_count() or 1))
    assert export(src, tmp_path / "out", ckpt, "-j", str(limit + 1), "-b", "1") == 2
    err = capsys.readouterr().err
    assert f"--workers {limit + 1}" in err and f"at most {limit}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_min_side_past_max_side_draws_within_max_side(ckpt, tmp_path) -> None:
    # --min-side 100000: the 64 px region was enlarged to 100032 px a side (a 30 GB array) before
    # --max-side shrank it, so every image failed with OpenCV's out-of-memory text.
    src = images(tmp_path / "in", ["a.png"])
    out = tmp_path / "out"
    assert export(src, out, ckpt, "--min-side", "100000", "--max-side", "300") == 0
    rec = manifest(out)["a.png"]
    assert rec["status"] == "ok", rec["error"]
    with Image.open(out / rec["files"]["rollout"]["overlay"]) as im:
        assert max(im.size) == 300 and min(im.size) >= 256  # within --max-side, enlarged (64 px -> 300)


def test_an_empty_out_is_named_as_the_problem(ckpt, tmp_path, capsys, monkeypatch) -> None:
    # --out '' was read as the current folder: "input 'a.png' is inside --out ''" (or, with the
    # inputs elsewhere, outputs written into the current folder).
    src = images(tmp_path / "in", ["a.png"])
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert export(src, "", ckpt) == 2
    err = capsys.readouterr().err
    assert "--out is empty" in err and "inside" not in err
    assert os.listdir(here) == []


def _mute_captioner(folder: Path) -> str:
    """A tiny random captioner whose first word is always ``<eos>``: every caption it generates is empty."""
    from batch_helpers import TINY_CAPTIONER, save_tiny

    return save_tiny(folder, "shapes-captioner", edit=lambda m: m.head.bias.__setitem__(m.vocab.eos_id, 1e4),
                     **TINY_CAPTIONER)


def test_an_empty_generated_caption_fails_its_image_saying_so(tmp_path, capsys) -> None:
    # The model ended the caption at once: the image was counted 'captioned', with empty .npz maps
    # and a figure of the image alone, and nothing said there was no word to explain.
    from batch_helpers import run

    ckpt = _mute_captioner(tmp_path / "ckpt")
    src = images(tmp_path / "in", ["a.png", "b.png"])
    out = tmp_path / "out"
    assert run("caption", src, "--out", out, "--model", ckpt, "-q", "-j", "0") == 1
    err = capsys.readouterr().err
    recs = manifest(out)
    assert sorted(recs) == ["a.png", "b.png"]
    for rec in recs.values():
        assert rec["status"] == "failed" and "empty caption" in rec["error"] and "--caption" in rec["error"]
        assert not rec.get("files")
    assert "empty caption" in err and "Traceback" not in err
    assert not list(out.glob("*.npz")) and not list(out.glob("*.caption.json"))
    # a given caption is explained as usual
    assert run("caption", src, "--out", tmp_path / "given", "--model", ckpt, "-q", "-j", "0", "--caption", "red") == 0


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (Linux: read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != b"Z":
                found.append(int(entry))
    return found


def test_sigterm_while_workers_start_stops_cleanly(ckpt, tmp_path) -> None:
    # SIGTERM to the process group while the DataLoader forked its workers: each half-started
    # worker ran the run's handler (a traceback each on stderr), and the main process was left
    # without the iterator, so it never shut the workers down and hung at exit joining them
    # (they ignore SIGTERM). Measured before the fix with 48 workers: tracebacks in 3 runs of 3,
    # a hang in 1.
    import signal
    import subprocess
    import time

    from batch_helpers import children, cli_process, summary, wait_for

    n = 32
    src = images(tmp_path / "in", [f"{i:02d}.png" for i in range(n)])
    out = tmp_path / "out"
    code = "import sys; from vitexplain import cli; cli.run(sys.argv[1:])"
    proc = cli_process(code, "export", src, "--out", out, "--model", ckpt, "--method", "rollout",
                       "-b", "1", "-j", str(n), "-q")
    wait_for(lambda: len(children(proc.pid)) >= 2, proc)  # workers are being forked
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        err = proc.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("the run did not end within 60 s of SIGTERM")
    assert proc.returncode == 143, err
    assert "Traceback" not in err, err
    deadline = time.monotonic() + 10
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group(proc.pid)  # no orphaned worker
    assert summary(out)["counts"]["images"] == n


@pytest.mark.parametrize("value", ["0", "-5", "1e-9"])
def test_a_bounded_number_option_says_its_bound(value, tmp_path, capsys) -> None:
    # --attention-budget 0 said "expected a number, got 0.0": the bound (>= 0.01) was not in the text.
    from batch_helpers import run

    src = images(tmp_path / "in", ["a.png"])
    assert run("explore", src, "--out", tmp_path / "p.html", "--attention-budget", value) == 2
    err = capsys.readouterr().err
    assert "--attention-budget" in err and "a number >= 0.01" in err
    assert not (tmp_path / "p.html").exists()


def test_a_tile_size_past_its_bound_is_a_usage_error(tmp_path, capsys) -> None:
    # --tile-size 100000 drew each per-word figure at 100000 px a tile: every image failed with
    # "MemoryError: Unable to allocate 90.1 GiB".
    from batch_helpers import run

    src = images(tmp_path / "in", ["a.png"])
    assert run("caption", src, "--out", tmp_path / "out", "--tile-size", "100000", "-q", "-j", "0") == 2
    err = capsys.readouterr().err
    assert "--tile-size" in err and "[0, 2048]" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_labels_file_saved_with_a_byte_order_mark_names_its_first_class(ckpt, tmp_path, capsys) -> None:
    # Notepad's "UTF-8" starts the file with U+FEFF: the first class was named "\ufeffround", so
    # --target round was an unknown label (the message showing the invisible mark) and the
    # manifest's labels carried it.
    src = images(tmp_path / "in", ["a.png"])
    labels = tmp_path / "labels.txt"
    labels.write_bytes("\ufeffround\r\nbox\r\ntri\r\nstar\r\nx\r\n".encode("utf-8"))
    out = tmp_path / "out"
    assert export(src, out, ckpt, "--labels", labels, "--target", "round") == 0, capsys.readouterr().err
    rec = manifest(out)["a.png"]
    assert rec["target"] == {"index": 0, "label": "round"}
    assert all("\ufeff" not in (p["label"] or "") for p in rec["predictions"])


def test_a_labels_file_that_is_not_utf8_is_a_usage_error(ckpt, tmp_path, capsys) -> None:
    # Latin-1 "café": a UnicodeDecodeError traceback.
    src = images(tmp_path / "in", ["a.png"])
    labels = tmp_path / "labels.txt"
    labels.write_bytes(b"caf\xe9\nbox\ntri\nstar\nx\n")
    assert export(src, tmp_path / "out", ckpt, "--labels", labels) == 2
    err = capsys.readouterr().err
    assert "--labels" in err and "not UTF-8" in err and "Traceback" not in err
