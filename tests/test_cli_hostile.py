"""The batch commands against a hostile output folder, killed runs and signals (second round of
hostile runs): links planted in ``--out``, ``kill -9`` with DataLoader workers, signals while the
run finishes, folders named like the run's own files.

Offline and small: a 1-block ViT of the zoo architecture (random weights), 64 px images.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batch_helpers import alive, children, cli_process, export, images, manifest, save_tiny, summary, wait_for
from vitexplain.batch.lock import LOCK_NAME, FolderBusyError, OutputLock


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


# ---------------------------------------------------------------------------------------------
# kill -9: the next run is never blocked, the DataLoader workers do not outlive the run
# ---------------------------------------------------------------------------------------------
# Images after the fourth never finish decoding: the workers are inside __getitem__ (where the
# DataLoader's own parent check never runs) when the main process is killed.
_HANGING_RUN = """
import sys, threading
from vitexplain import cli
from vitexplain.batch.decoding import ImageDataset
original = ImageDataset.__getitem__
def getitem(self, i):
    if i >= 4:
        threading.Event().wait()
    return original(self, i)
ImageDataset.__getitem__ = getitem
cli.run(sys.argv[1:])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads worker processes from /proc")
def test_kill_9_leaves_no_worker_and_no_lock_that_blocks_the_next_run(ckpt, tmp_path) -> None:
    src = images(tmp_path / "in", [f"i{i}.png" for i in range(12)])
    out = tmp_path / "out"
    proc = cli_process(_HANGING_RUN, "export", src, "--out", out, "--model", ckpt, "--method", "rollout",
                       "-q", "-j", "2", "-b", "2")
    workers: list[int] = []
    try:
        # two batches written (their records may wait for the main thread); the workers stuck on the rest
        wait_for(lambda: len(list(out.glob("*.rollout.png"))) >= 4, proc)
        workers = children(proc.pid)
        assert len(workers) >= 2, workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # the workers die with their parent (they would otherwise hang on, holding the lock)
        wait_for(lambda: not any(alive(w) for w in workers), timeout=30)
        assert export(src, out, ckpt) == 0  # not refused as "in use": the same command resumes
        done = summary(out)["counts"]["skipped"]
        assert summary(out)["counts"] == {"images": 12, "ok": 12 - done, "failed": 0, "skipped": done}
    finally:
        for pid in [*(workers or children(proc.pid)), proc.pid]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_the_lock_is_not_held_by_a_forked_child(tmp_path) -> None:
    """A child forked while the lock is held (a DataLoader worker) does not hold it: once the
    parent is gone, a new run gets the lock although the child lives on."""
    out = tmp_path / "out"
    out.mkdir()
    holder = cli_process(textwrap.dedent(f"""
        import os, sys, threading
        from pathlib import Path
        from vitexplain.batch.lock import OutputLock
        OutputLock(Path({str(out)!r}), "test").acquire()
        if os.fork() == 0:
            threading.Event().wait()  # the child lives on, holding whatever it inherited
        print("locked", flush=True)
        threading.Event().wait()
    """), stdout=subprocess.PIPE)
    child = None
    try:
        assert holder.stdout.readline().strip() == "locked"
        (child,) = children(holder.pid)
        with pytest.raises(FolderBusyError, match=f"pid {holder.pid}"):
            OutputLock(out, "second").acquire()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert alive(child)
        with OutputLock(out, "third"):  # the child did not inherit the lock
            assert (out / LOCK_NAME).is_file()
    finally:
        for pid in (holder.pid, child):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
        holder.wait()


def test_a_second_lock_in_the_same_process_is_refused_and_leaves_the_first_held(tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with OutputLock(out, "first"):
        for _ in range(2):  # the refusal must not release the first lock (POSIX locks would)
            with pytest.raises(FolderBusyError, match=f"pid {os.getpid()}"):
                OutputLock(out, "second").acquire()
    with OutputLock(out, "third"):
        pass


# ---------------------------------------------------------------------------------------------
# a signal while the run finishes (every image done; merging, gallery, summary) still leaves a
# complete manifest, gallery and summary
# ---------------------------------------------------------------------------------------------
def _signal_self_during(monkeypatch, target: str, sig: int) -> list[int]:
    """Patch ``target`` (module.function) to signal this process once, then do its work."""
    import importlib

    module_name, name = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    sent: list[int] = []

    def patched(*args, **kwargs):
        if not sent:
            sent.append(sig)
            os.kill(os.getpid(), sig)  # delivered to this (the main) thread at once
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, patched)
    return sent


@pytest.mark.parametrize("where", ["vitexplain.batch.driver.merge_manifest", "vitexplain.viz.gallery.render_gallery",
                                   "vitexplain.batch.driver.build_summary"])
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_finishing_still_writes_manifest_gallery_and_summary(where, sig, code, ckpt, tmp_path,
                                                                            monkeypatch) -> None:
    src = images(tmp_path / "in", ["a.png", "b.png", "c.png"])
    out = tmp_path / "out"
    sent = _signal_self_during(monkeypatch, where, sig)
    assert export(src, out, ckpt, "--html") == code
    assert sent == [sig]
    assert set(manifest(out)) == {"a.png", "b.png", "c.png"}
    assert summary(out)["counts"] == {"images": 3, "ok": 3, "failed": 0, "skipped": 0}
    assert summary(out)["status"] == "interrupted" and summary(out)["manifest_records"] == 3
    assert "c.png" in (out / "index.html").read_text()
    assert not list(out.glob("manifest.part-*")) and not list(out.rglob(".*.tmp"))
    monkeypatch.undo()
    assert export(src, out, ckpt, "--html") == 0  # nothing left to do
    assert summary(out)["counts"]["skipped"] == 3


_KILLED_WHILE_FINISHING = """
import os, signal, sys
from vitexplain import cli
from vitexplain.batch import driver
original = driver.merge_manifest
def merge(*args, **kwargs):
    records = original(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # the manifest is merged, the gallery and summary are not
driver.merge_manifest = merge
cli.run(sys.argv[1:])
"""


def test_a_rerun_completes_a_finish_cut_short_by_kill_9(ckpt, tmp_path) -> None:
    src = images(tmp_path / "in", ["a.png", "b.png"])
    out = tmp_path / "out"
    proc = cli_process(_KILLED_WHILE_FINISHING, "export", src, "--out", out, "--model", ckpt, "--method",
                       "rollout", "-q", "-j", "0", "--html")
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert set(manifest(out)) == {"a.png", "b.png"} and not (out / "summary.json").exists()
    assert export(src, out, ckpt, "--html") == 0
    assert summary(out)["counts"] == {"images": 2, "ok": 0, "failed": 0, "skipped": 2}
    assert "b.png" in (out / "index.html").read_text()


# ---------------------------------------------------------------------------------------------
# a folder where the run writes its own files is a usage error before the model loads
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["manifest.jsonl", "summary.json", "index.html", ".vitexplain.lock"])
def test_a_folder_named_like_the_run_s_own_files_is_a_usage_error(name, ckpt, tmp_path, monkeypatch, capsys) -> None:
    src = images(tmp_path / "in", ["a.png"])
    out = tmp_path / "out"
    (out / name / "x").mkdir(parents=True)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr("vitexplain.batch.export.load_model", no_model)
    assert export(src, out, ckpt, "--html") == 2
    err = capsys.readouterr().err
    assert f"{name!r}" in err and "folder" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == [name]  # nothing written


# ---------------------------------------------------------------------------------------------
# the gallery links inputs whose names are not UTF-8 by their real bytes
# ---------------------------------------------------------------------------------------------
def test_gallery_links_reach_inputs_whose_names_are_not_utf8(ckpt, tmp_path) -> None:
    import re
    from urllib.parse import unquote_to_bytes

    src = images(tmp_path / "in", [b"caf\xe9.png", b"sub\xff/na\xefve.png", "plain.png"])
    out = tmp_path / "out"
    assert export(src, out, ckpt, "--html") == 0
    page = (out / "index.html").read_bytes().decode("utf-8")
    links = {unquote_to_bytes(h) for h in re.findall(r'<img src="([^"]+)" alt="input"', page)}
    reached = {os.path.realpath(os.path.join(os.fsencode(out), link)) for link in links}
    expected = {os.path.realpath(os.path.join(os.fsencode(src), name))
                for name in (b"caf\xe9.png", b"sub\xff/na\xefve.png", b"plain.png")}
    assert reached == expected, links
