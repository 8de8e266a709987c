"""The batch commands under hostile conditions: each test reproduces a failure of a hostile run
(issue 14, F1-F12 and signals) and checks the fixed behaviour.

Offline and small: a 1-block ViT of the zoo architecture (random weights), 64 px images. Faults
(a full disk, unreadable folders, a read-only --out) are simulated by patching the OS calls the
engine makes, since tests run as root here (permission bits do not stop root) and may not mount
file systems.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitexplain as vx
from batch_helpers import export as _export
from batch_helpers import images as _images
from batch_helpers import manifest as _manifest
from batch_helpers import run as _run
from batch_helpers import env, read_only_below, unreadable_folder, wait_for
from batch_helpers import save_tiny as _save_tiny
from batch_helpers import TINY_CAPTIONER
from batch_helpers import summary as _summary
from vitexplain.batch import manifest as manifest_mod

# ---------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save_tiny(tmp_path_factory.mktemp("ckpt"))


# ---------------------------------------------------------------------------------------------
# F1: extreme aspect ratios are bad files, never a multi-GB resize
# ---------------------------------------------------------------------------------------------
def test_f1_one_pixel_high_strip_is_a_bad_file_without_a_huge_resize(ckpt, tmp_path, monkeypatch) -> None:
    src = _images(tmp_path / "in", ["good.png"])
    Image.fromarray(np.full((1, 400_000, 3), 90, np.uint8)).save(src / "strip.png")  # ~1 KB
    Image.fromarray(np.full((400_000, 1, 3), 90, np.uint8)).save(src / "pole.png")
    requested: list[int] = []
    original = Image.Image.resize

    def resize(self, size, *args, **kwargs):  # record every resize; refuse (never run) a huge one
        requested.append(int(size[0]) * int(size[1]))
        if requested[-1] > 50_000_000:
            raise MemoryError("test: a resize this large would need gigabytes")
        return original(self, size, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", resize)
    out = tmp_path / "out"
    assert _export(src, out, ckpt) == 1
    records = _manifest(out)
    assert records["good.png"]["status"] == "ok"
    for key in ("strip.png", "pole.png"):
        assert records[key]["status"] == "failed" and "aspect ratio" in records[key]["error"], records[key]
        assert key in records[key]["error"]
    # the oracle: no resize of more than 50 megapixels (200 MB) was ever asked for
    assert max(requested, default=0) <= 50_000_000


def test_f1_preprocess_limit_keeps_normal_panoramas() -> None:
    from vitexplain.data.images import preprocess

    kwargs = dict(input_size=(64, 64), mean=(0.5,) * 3, std=(0.5,) * 3, crop_pct=0.875)
    x, _ = preprocess(np.zeros((100, 1600, 3), np.uint8), **kwargs)  # 16:1 panorama: fine
    assert x.shape == (1, 3, 64, 64)
    with pytest.raises(ValueError, match="aspect ratio"):
        preprocess(np.zeros((1, 400_000, 3), np.uint8), **kwargs)
    x, _ = preprocess(np.zeros((1, 400_000, 3), np.uint8), crop=False, **kwargs)  # resized whole: fine
    assert x.shape == (1, 3, 64, 64)


# ---------------------------------------------------------------------------------------------
# F2: inputs inside --out
# ---------------------------------------------------------------------------------------------
def test_f2_inputs_inside_out_are_refused(ckpt, tmp_path, capsys) -> None:
    g = _images(tmp_path / "G", ["a.png", "sub/b.png"])
    before = sorted(p.name for p in g.rglob("*"))
    for args in ([str(g / "**" / "*.png")], [g / "sub"], [g / "a.png"]):
        assert _export(*args, g, ckpt) == 2, args
        assert "inside --out" in capsys.readouterr().err
    assert sorted(p.name for p in g.rglob("*")) == before  # nothing written beside the inputs
    # a glob from above --out skips --out instead (like walking a folder that contains it)
    out = tmp_path / "out"
    assert _export(g, out, ckpt) == 0
    assert _export(str(tmp_path / "**" / "*.png"), out, ckpt, "--overwrite") == 0
    assert set(_manifest(out)) == {"a.png", "sub/b.png", "G/a.png", "G/sub/b.png"}


# ---------------------------------------------------------------------------------------------
# F3: two runs into one --out
# ---------------------------------------------------------------------------------------------
def test_f3_a_second_run_into_a_busy_out_is_refused_and_nothing_is_lost(ckpt, tmp_path, monkeypatch,
                                                                       capsys) -> None:
    from vitexplain.batch.decoding import ImageDataset as _ImageDataset

    first = _images(tmp_path / "first", [f"f{i}.png" for i in range(6)])
    second = _images(tmp_path / "second", [f"s{i}.png" for i in range(3)], seed=5)
    out = tmp_path / "out"
    codes: list[int] = []
    original = _ImageDataset.__getitem__

    def getitem(self, i):  # while the first run is half done, a second run starts into the same --out
        if Path(self.paths[i]).name == "f3.png" and not codes:
            codes.append(_export(second, out, ckpt, "-b", "1"))
        return original(self, i)

    monkeypatch.setattr(_ImageDataset, "__getitem__", getitem)
    assert _export(first, out, ckpt, "-b", "2") == 0
    assert codes == [2] and "in use by another vitexplain run" in capsys.readouterr().err
    records = _manifest(out)
    assert set(records) == {f"f{i}.png" for i in range(6)}  # every record of the first run
    assert _summary(out)["counts"]["ok"] == 6 == _summary(out)["manifest_records"]
    monkeypatch.setattr(_ImageDataset, "__getitem__", original)
    assert _export(second, out, ckpt) == 0  # afterwards: both runs' records are kept
    assert set(_manifest(out)) == {f"f{i}.png" for i in range(6)} | {f"s{i}.png" for i in range(3)}


def test_f3_lock_held_by_another_live_process_and_stale_lock(ckpt, tmp_path, capsys) -> None:
    src = _images(tmp_path / "in", ["a.png"])
    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".vitexplain.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, json, os, threading
            fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
            fcntl.lockf(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps({{"pid": os.getpid(), "host": "h", "command": "c", "started": 0}}).encode())
            print("locked", flush=True)
            threading.Event().wait()  # holds the lock until killed
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert _export(src, out, ckpt) == 2
        err = capsys.readouterr().err
        assert f"pid {holder.pid}" in err and "in use by another vitexplain run" in err
    finally:
        holder.kill()
        holder.wait()
    # the holder died (kill -9 leaves its lock file behind): the next run takes over
    assert lock.exists()
    assert _export(src, out, ckpt) == 0
    assert not lock.exists() and _manifest(out)["a.png"]["status"] == "ok"


# ---------------------------------------------------------------------------------------------
# F4: torn manifest lines, a full disk
# ---------------------------------------------------------------------------------------------
def test_f4_a_torn_line_left_by_a_crash_swallows_no_record(ckpt, tmp_path) -> None:
    src = _images(tmp_path / "in", ["a.png", "b.png", "c.png"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.rank0.jsonl").write_bytes(b'{"key": "old.png", "input": "/x/ol')  # killed mid-line
    assert _export(src, out, ckpt) == 0
    records = _manifest(out)
    assert {"a.png", "b.png", "c.png"} <= set(records)
    assert all(records[k]["status"] == "ok" for k in ("a.png", "b.png", "c.png"))
    assert _summary(out)["counts"] == {"images": 3, "ok": 3, "failed": 0, "skipped": 0}


def test_f4_read_repairs_a_record_glued_to_a_torn_one(tmp_path) -> None:
    whole = {"key": "b.png", "status": "ok", "time": 2.0}
    (tmp_path / "manifest.jsonl").write_text(
        json.dumps({"key": "a.png", "status": "ok", "time": 1.0}) + "\n"
        + '{"key": "x.png", "status": "o' + json.dumps(whole) + "\n"
        + '{"key": "y.png", "sta', encoding="utf-8")
    assert manifest_mod.read_manifest(tmp_path) == {"a.png": {"key": "a.png", "status": "ok", "time": 1.0},
                                                     "b.png": whole}


def _path_of(name, dir_fd) -> str:
    """The path of ``name`` relative to the open folder ``dir_fd`` (Linux: /proc/self/fd)."""
    if dir_fd is None:
        return os.fsdecode(name)
    return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fsdecode(name))


def _full_disk(monkeypatch, out: Path, *, after_pngs: int, everything: bool) -> dict[str, int]:
    """Make moving finished files into ``out`` fail with ENOSPC: after ``after_pngs`` overlays
    (PNG files only, or every file of ``out`` when ``everything``)."""
    real_replace = os.replace
    state = {"pngs": 0}
    root = str(out)

    def replace(src, dst, *args, **kwargs):
        dst_s = _path_of(dst, kwargs.get("dst_dir_fd"))
        if dst_s.startswith(root):
            if dst_s.endswith(".png"):
                state["pngs"] += 1
            if state["pngs"] > after_pngs and (everything or dst_s.endswith(".png")):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    return state


def test_f4_full_disk_stops_with_exit_74_and_a_summary(ckpt, tmp_path, monkeypatch, capsys) -> None:
    src = _images(tmp_path / "in", [f"i{i}.png" for i in range(8)])
    out = tmp_path / "out"
    _full_disk(monkeypatch, out, after_pngs=3, everything=False)  # overlays fail; small files still fit
    code = _export(src, out, ckpt, "-b", "2", "--write-threads", "1")
    err = capsys.readouterr().err
    assert code == 74, err
    assert "No space left on device" in err and "rerun" in err
    summary = _summary(out)
    assert summary["status"] == "output_error" and "No space left on device" in summary["error"]
    assert summary["counts"]["ok"] == 3 and summary["counts"]["failed"] == 0
    assert len(_manifest(out)) == 3  # what was done is recorded; nothing recorded as failed
    assert not list(out.rglob(".*.tmp"))
    monkeypatch.undo()  # space freed: the same command resumes
    assert _export(src, out, ckpt, "-b", "2") == 0
    assert _summary(out)["counts"] == {"images": 8, "ok": 5, "failed": 0, "skipped": 3}
    assert all(r["status"] == "ok" for r in _manifest(out).values()) and len(_manifest(out)) == 8


def test_f4_full_disk_for_every_file_reports_on_stderr_and_resumes(ckpt, tmp_path, monkeypatch, capsys) -> None:
    src = _images(tmp_path / "in", [f"i{i}.png" for i in range(6)])
    out = tmp_path / "out"
    _full_disk(monkeypatch, out, after_pngs=2, everything=True)
    assert _export(src, out, ckpt, "-b", "2", "--write-threads", "1") == 74
    err = capsys.readouterr().err
    assert "No space left on device" in err and "2 images done" in err
    assert not (out / "summary.json").exists()
    assert len(manifest_mod.read_manifest(out)) == 2  # the parts keep what was done
    monkeypatch.undo()
    assert _export(src, out, ckpt) == 0
    assert _summary(out)["counts"] == {"images": 6, "ok": 4, "failed": 0, "skipped": 2}


# ---------------------------------------------------------------------------------------------
# F5: --out that cannot be written is a usage error before the model loads
# ---------------------------------------------------------------------------------------------
def test_f5_unwritable_or_dangling_out_is_a_usage_error(ckpt, tmp_path, monkeypatch, capsys) -> None:
    from vitexplain.batch import export as export_module

    src = _images(tmp_path / "in", ["a.png"])

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(export_module, "load_model", no_model)  # not models': modules imported meanwhile keep it
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "missing-target")
    assert _export(src, dangling, ckpt) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "missing-target").exists()

    readonly = tmp_path / "ro"
    readonly.mkdir()
    read_only_below(monkeypatch, readonly)
    for out in (readonly, readonly / "new" / "out"):
        assert _export(src, out, ckpt) == 2
        assert "not writable: Read-only file system" in capsys.readouterr().err
    assert list(readonly.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# F6: file names that are not UTF-8
# ---------------------------------------------------------------------------------------------
def test_f6_non_utf8_names_give_valid_utf8_json(ckpt, tmp_path) -> None:
    src = _images(tmp_path / "in", [b"caf\xe9.png"])
    (src / os.fsdecode(b"bad\xff.png")).write_bytes(b"not an image")
    out = tmp_path / "out"
    assert _export(src, out, ckpt, "--html") == 1
    records = _manifest(out)  # strict UTF-8 decode
    assert set(records) == {"caf%E9.png", "bad%FF.png"}
    good = records["caf%E9.png"]
    assert good["status"] == "ok" and good["input"].endswith("caf\\xe9.png")
    assert bytes.fromhex(good["input_bytes_hex"]) == os.fsencode(src) + b"/caf\xe9.png"
    assert (out / "caf%E9.png.rollout.png").is_file()
    summary = _summary(out)
    assert summary["failures"][0]["input"].endswith("bad\\xff.png")
    (out / "index.html").read_bytes().decode("utf-8")
    assert _export(src, out, ckpt) == 1  # resume works with such names
    assert _summary(out)["counts"]["skipped"] == 1


def test_f6_caption_json_is_valid_utf8(tmp_path) -> None:
    cap = _save_tiny(tmp_path / "cap", "shapes-captioner", **TINY_CAPTIONER)
    src = _images(tmp_path / "in", [b"caf\xe9.png"])
    out = tmp_path / "out"
    assert _run("caption", src, "--out", out, "--model", cap, "--max-len", "2", "-q", "-j", "0") == 0
    doc = json.loads((out / "caf%E9.png.caption.json").read_bytes().decode("utf-8"))
    assert doc["input"].endswith("caf\\xe9.png") and doc["key"] == "caf%E9.png"
    _summary(out)


# ---------------------------------------------------------------------------------------------
# F7/F8: stable, collision-free, length-safe keys
# ---------------------------------------------------------------------------------------------
def test_f7_swapped_roots_keep_their_keys(ckpt, tmp_path) -> None:
    a = _images(tmp_path / "A", ["x.png"])
    b = _images(tmp_path / "B", ["x.png"], seed=4)
    out = tmp_path / "out"
    common = ("--out", out, "--model", ckpt, "--method", "rollout", "-q", "-j", "0")
    assert _run("export", a, b, *common) == 0
    assert _run("export", b, a, *common) == 0
    assert set(_manifest(out)) == {"A/x.png", "B/x.png"}  # 2 images, 2 records
    assert _summary(out)["counts"] == {"images": 2, "ok": 0, "failed": 0, "skipped": 2}


def test_f7_a_folder_named_like_another_image_s_output(ckpt, tmp_path) -> None:
    src = _images(tmp_path / "in", ["x.png", "x.png.rollout.png/y.png", "summary.json/z.png"])
    out = tmp_path / "out"
    assert _export(src, out, ckpt) == 0
    records = _manifest(out)
    assert len(records) == 3 and all(r["status"] == "ok" for r in records.values())
    assert (out / "x.png.rollout.png").is_file() and json.loads((out / "summary.json").read_text())
    for rec in records.values():
        assert (out / rec["files"]["rollout"]["overlay"]).is_file()
    assert _export(src, out, ckpt) == 0 and _summary(out)["counts"]["skipped"] == 3


def test_f8_a_251_byte_name_works_and_is_stable(ckpt, tmp_path) -> None:
    long_name = "é" * 60 + "a" * 127 + ".png"  # 120 + 127 + 4 = 251 bytes
    assert len(long_name.encode()) == 251
    src = _images(tmp_path / "in", [long_name, "a" * 247 + ".png"])
    out = tmp_path / "out"
    assert _export(src, out, ckpt, "--save-maps") == 0
    records = _manifest(out)
    assert len(records) == 2
    for key, rec in records.items():
        assert rec["status"] == "ok" and key.endswith(".png") and len(key.encode()) <= 191
        for rel in rec["files"]["rollout"].values():
            assert (out / rel).is_file() and len(rel.encode()) <= 255
    assert _export(src, out, ckpt, "--save-maps") == 0
    assert set(_manifest(out)) == set(records) and _summary(out)["counts"]["skipped"] == 2


# ---------------------------------------------------------------------------------------------
# F9: unreadable folders
# ---------------------------------------------------------------------------------------------
def test_f9_unreadable_folder_is_reported(ckpt, tmp_path, monkeypatch, capsys) -> None:
    src = _images(tmp_path / "in", ["a.png", "locked/b.png"])
    locked = str(src / "locked")
    unreadable_folder(monkeypatch, locked)
    out = tmp_path / "out"
    assert _export(src, out, ckpt) == 1
    err = capsys.readouterr().err
    assert f"cannot read folder {locked}" in err and "Permission denied" in err
    records = _manifest(out)
    assert records["a.png"]["status"] == "ok"
    folder = records[locked + "/"]
    assert folder["status"] == "failed" and folder["kind"] == "folder" and "Permission denied" in folder["error"]
    summary = _summary(out)
    assert summary["counts"]["unreadable_folders"] == 1 and summary["failures"][0]["input"] == locked


# ---------------------------------------------------------------------------------------------
# F10: a zoo checkpoint whose config cannot build a model
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_args", [{"no_such_arg": 3}, "not a dict"])
def test_f10_bad_zoo_json_is_a_usage_error(model_args, ckpt, tmp_path, capsys) -> None:
    import shutil

    src = _images(tmp_path / "in", ["a.png"])
    cfg = json.loads(Path(ckpt).read_text())
    cfg["model_args"] = {**cfg["model_args"], **model_args} if isinstance(model_args, dict) else model_args
    (tmp_path / "bad.json").write_text(json.dumps(cfg))
    shutil.copy(Path(ckpt).with_suffix(".safetensors"), tmp_path / "bad.safetensors")
    out = tmp_path / "out"
    assert _export(src, out, tmp_path / "bad.json") == 2
    err = capsys.readouterr().err
    assert "cannot load it" in err and "model_args" in err and not out.exists()


# ---------------------------------------------------------------------------------------------
# F11: option values checked against the method's declared ranges
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["-3", "1.5", "'x'"])
def test_f11_option_values_out_of_the_declared_range_are_usage_errors(value, ckpt, tmp_path, capsys) -> None:
    src = _images(tmp_path / "in", ["a.png"])
    out = tmp_path / "out"
    assert _export(src, out, ckpt, "--option", f"rollout.discard_ratio={value}") == 2
    assert "rollout option 'discard_ratio' must be a number in [0, 1)" in capsys.readouterr().err
    assert not out.exists()
    assert _export(src, out, ckpt, "--option", "rollout.discard_ratio=0.5") == 0


def test_f11_api_checks_option_ranges_too(ckpt, tmp_path) -> None:
    from vitexplain.batch.export import ExportOptions, export

    src = _images(tmp_path / "in", ["a.png"])
    opts = ExportOptions(inputs=[str(src)], out=str(tmp_path / "o"), model=ckpt, methods=["rollout"],
                         method_options={"rollout": {"head_fusion": "median"}}, quiet=True)
    with pytest.raises(vx.OptionError, match="head_fusion"):
        export(opts)


# ---------------------------------------------------------------------------------------------
# F12: NaN / inf become clear errors
# ---------------------------------------------------------------------------------------------
def test_f12_nan_model_is_a_usage_error_and_a_nan_map_fails_its_image(ckpt, tmp_path, monkeypatch,
                                                                      capsys) -> None:
    from safetensors.torch import load_file, save_file

    src = _images(tmp_path / "in", ["a.png", "b.png", "c.png"])
    folder = tmp_path / "nan"
    folder.mkdir()
    nan_json = folder / "nan.json"
    nan_json.write_text(Path(ckpt).read_text())
    state = load_file(str(Path(ckpt).with_suffix(".safetensors")))
    head = next(k for k in state if k.startswith("head") and k.endswith("weight"))
    state[head] = torch.full_like(state[head], float("nan"))
    save_file(state, str(folder / "nan.safetensors"))
    assert _export(src, tmp_path / "o1", nan_json) == 2
    assert "not finite" in capsys.readouterr().err

    original = vx.Explainer.explain

    def explain(self, x, *args, **kwargs):  # one image's map breaks down numerically
        result = original(self, x, *args, **kwargs)
        if x.shape[0] > 1:
            result[0].maps[1] = float("nan")
        return result

    monkeypatch.setattr(vx.Explainer, "explain", explain)
    out = tmp_path / "o2"
    assert _export(src, out, ckpt) == 1
    records = _manifest(out)
    assert records["b.png"]["status"] == "failed" and "not finite" in records["b.png"]["error"]
    assert records["a.png"]["status"] == records["c.png"]["status"] == "ok"


@pytest.mark.parametrize("error", [
    vx.NumericalError("test: this image's scores are not finite"),
    vx.UnsupportedMethodError("test: integrated_gradients' path is flat for this image"),  # (failed the batch before)
    MemoryError("test: out of memory"),  # (one image at a time may fit: failed the batch before)
], ids=lambda e: type(e).__name__)
def test_one_image_that_fails_its_batch_fails_alone(ckpt, tmp_path, monkeypatch, error) -> None:
    """A method that fails on one image (a score not finite, a refusal for that image, memory) raised for the whole
    batch, and every image of it was recorded failed (a resume failed them all again): the batch's images are then
    explained one by one, so only that image fails, with its own error, and its neighbours' outputs are written."""
    src = _images(tmp_path / "in", ["a.png", "b.png", "c.png", "d.png"])
    Image.fromarray(np.full((64, 64, 3), 255, np.uint8)).save(src / "b.png")  # the one white image
    original = vx.Explainer.explain
    seen: list[int] = []

    def explain(self, x, *args, **kwargs):  # fails whenever the white image is in the batch
        white = (x.flatten(1).amin(1) > 1.0).any()  # (normalised: white is above 1 in every channel)
        if x.shape[0] > 1 or white:
            seen.append(int(x.shape[0]))
        if bool(white):
            raise error
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(vx.Explainer, "explain", explain)
    out = tmp_path / "out"
    assert _export(src, out, ckpt, "--batch-size", "4") == 1
    records = _manifest(out)
    assert records["b.png"]["status"] == "failed" and str(error) in records["b.png"]["error"]
    assert "b.png" in records["b.png"]["error"]
    for key in ("a.png", "c.png", "d.png"):
        assert records[key]["status"] == "ok" and records[key]["files"], records[key]
    assert seen == [4, 1]  # (the batch, then the white image alone; the others alone succeed)


def test_f12_api_options_are_checked_like_the_cli(tmp_path) -> None:
    from vitexplain.batch.caption import CaptionOptions, export_captions
    from vitexplain.batch.export import ExportOptions, export

    src = _images(tmp_path / "in", ["a.png"])
    for bad, message in ((dict(batch_size=0), "--batch-size: expected a positive integer"),
                         (dict(alpha=1.5), "--alpha: expected a number in [0, 1]"),
                         (dict(workers=-1), "--workers")):
        with pytest.raises(vx.UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
            export(ExportOptions(inputs=[str(src)], out=str(tmp_path / "o"), **bad))
    with pytest.raises(vx.UsageError, match="--max-len"):
        export_captions(CaptionOptions(inputs=[str(src)], out=str(tmp_path / "o"), max_len=0))
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------
# signals and temporary files
# ---------------------------------------------------------------------------------------------
def _killed_write(out: Path, rel: str, monkeypatch) -> Path:
    """The temporary file a run writing ``rel`` into ``out`` leaves when it is killed mid-write (its
    ``Writer`` fails at the write and does not get to remove it); returns its path."""
    from vitexplain import files

    folder = (out / rel).parent
    folder.mkdir(parents=True, exist_ok=True)
    before = set(folder.iterdir())

    def killed(fd, data):
        raise OSError(errno.EIO, "killed")

    with monkeypatch.context() as m:
        m.setattr(files.os, "write", killed)
        m.setattr(files, "_unlink_quietly", lambda *a, **k: None)  # kill -9: no cleanup
        with pytest.raises(OSError):
            files.Writer(out).write(rel, b"half a png")
    (left,) = set(folder.iterdir()) - before
    return left


def test_stale_temp_files_of_killed_runs_are_cleaned(ckpt, tmp_path, monkeypatch) -> None:
    src = _images(tmp_path / "in", ["sub/a.png"])
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    # what kill -9 leaves mid-write: a temporary file, and the run's unmerged manifest part
    stale = _killed_write(out, "sub/a.rollout.png", monkeypatch)
    (out / "manifest.part-0123456789ab-rank0.jsonl").write_text(json.dumps({"key": "x.png", "status": "ok"}) + "\n")
    top = _killed_write(out, "summary.json", monkeypatch)  # a summary being replaced when the run was killed
    mine = out / "sub" / ".notes.tmp"  # not our pattern: kept
    mine.write_text("user file")
    assert _export(src, out, ckpt) == 0
    assert not stale.exists() and not top.exists() and mine.exists()
    assert _summary(out)["cleaned_temp_files"] == 2


class _LiveWrite:
    """Another run's write in progress: ``Writer(out).write(rel, data)`` in a thread, held inside its
    ``os.write`` (its temporary file exists) until :meth:`finish`."""

    def __init__(self, out: Path, rel: str, monkeypatch) -> None:
        import threading

        from vitexplain import files

        self.go, self.inside, self.error = threading.Event(), threading.Event(), None
        real = os.write

        def write(fd, data):
            if threading.current_thread().name == "other-run":
                self.inside.set()
                self.go.wait(60)
            return real(fd, data)

        monkeypatch.setattr(files.os, "write", write)

        def job():
            try:
                files.Writer(out).write(rel, b"the other run's file")
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                self.error = e

        self.thread = threading.Thread(target=job, name="other-run")
        self.thread.start()
        assert self.inside.wait(60)
        self.temps = [p for p in (out / rel).parent.iterdir() if p.name.endswith(".tmp")]
        assert len(self.temps) == 1

    def finish(self) -> None:
        self.go.set()
        self.thread.join(60)
        assert self.error is None, self.error


@pytest.mark.parametrize("nesting", ["inner", "outer"])
def test_a_run_never_removes_the_temporary_files_of_a_live_run_in_a_nested_out(nesting, ckpt, tmp_path,
                                                                                  monkeypatch) -> None:
    """Two live runs, one's --out inside the other's: neither's start-up cleanup removes the other's
    temporary files. 'inner': the new run's --out is a folder the other run writes into; 'outer': the new
    run's --out holds the other's (and a killed run's manifest part, so it cleans every folder below)."""
    src = _images(tmp_path / "in", ["a.png"])
    outer = tmp_path / "out"
    inner = outer / "sub"
    inner.mkdir(parents=True)
    if nesting == "inner":  # the live run writes out/sub/b.png; the new run has --out out/sub
        live, new_out, rel = _LiveWrite(outer, "sub/b.png", monkeypatch), inner, inner / "b.png"
    else:  # the live run has --out out/sub; the new run has --out out
        (outer / "manifest.part-0123456789ab-rank0.jsonl").write_text(json.dumps({"key": "x", "status": "ok"}) + "\n")
        live, new_out, rel = _LiveWrite(inner, "deep/b.png", monkeypatch), outer, inner / "deep" / "b.png"
    try:
        assert _export(src, new_out, ckpt) == 0
        assert all(t.exists() for t in live.temps), "the other run's temporary file was removed"
        assert _summary(new_out)["cleaned_temp_files"] == 0
    finally:
        live.finish()
    assert rel.read_bytes() == b"the other run's file"


# Images from the ninth on wait for a release file before they decode (in the main process
# or a DataLoader worker): the run is mid-way, with two batches of four written, when it is
# signalled, and it finishes only what was in flight.
_GATED_RUN = """
import os, sys, time
from vitexplain import cli
from vitexplain.batch.decoding import ImageDataset
original = ImageDataset.__getitem__
release = os.environ["VX_TEST_RELEASE"]
def gated(self, i):
    while i >= 8 and not os.path.exists(release):
        time.sleep(0.01)
    return original(self, i)
ImageDataset.__getitem__ = gated
cli.run(sys.argv[1:])
"""


@pytest.mark.parametrize("sig, code, workers", [(signal.SIGTERM, 143, "0"), (signal.SIGINT, 130, "2")])
def test_signals_end_the_run_with_a_summary_of_what_was_done(sig, code, workers, ckpt, tmp_path) -> None:
    src = _images(tmp_path / "in", [f"i{i:03d}.png" for i in range(16)])
    out = tmp_path / "out"
    release = tmp_path / "release"
    proc = subprocess.Popen(
        [sys.executable, "-c", _GATED_RUN, "export", str(src), "--out", str(out), "--model", ckpt,
         "--method", "rollout", "-q", "-j", workers, "-b", "4"],
        stderr=subprocess.PIPE, text=True, env={**env(), "VX_TEST_RELEASE": str(release)}, start_new_session=True)
    try:
        wait_for(lambda: len(list(out.glob("*.rollout.png"))) >= 8, proc)  # two batches written
        os.killpg(proc.pid, sig)  # the whole process group, as a terminal or a job scheduler does
        release.touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, err
    summary = _summary(out)
    assert summary["status"] == "interrupted"
    assert summary["counts"]["ok"] == 8 and set(_manifest(out)) == {f"i{i:03d}.png" for i in range(8)}
    assert not list(out.rglob(".*.tmp")) and not list(out.glob("manifest.part-*"))
    assert _export(src, out, ckpt) == 0  # the same command resumes
    assert _summary(out)["counts"] == {"images": 16, "ok": 8, "failed": 0, "skipped": 8}
