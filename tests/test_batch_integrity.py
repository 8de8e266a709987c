"""What resume trusts (vitexplain.batch.integrity): a file with its recorded size and mtime, older than
the manifest, is trusted unread; one of the right size but another mtime, or of the manifest's own
clock tick, is hashed; a wrong size, a missing file or a link is damage; an older version's record
(no checksums) is only checked for its files' presence."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vitexplain.batch import integrity
from vitexplain.batch.integrity import RecordingWriter, damage, has_checksums, stat_horizon
from vitexplain.files import Writer

FILES = {"rollout": {"figure": "a.png.rollout.png", "maps": "sub/a.png.rollout.npy"}}
CHANGED = (FILES["rollout"]["maps"], "damaged: its content differs from what the run wrote")


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict]:
    """An output folder with two files written as a run writes them, and their image's record."""
    out = tmp_path / "out"
    out.mkdir()
    sums: dict = {}
    w = RecordingWriter(Writer(out), sums)
    w.write(FILES["rollout"]["figure"], b"figure" * 100)
    w.write(FILES["rollout"]["maps"], bytes(range(256)) * 4)
    (out / "manifest.jsonl").write_bytes(b"")
    return out, {"files": FILES, "checksums": sums}


def _settle(out: Path, delta_ns: int = 10**9) -> int:
    """Date the manifest ``delta_ns`` after the newest file, or with 0 in the oldest file's tick (the files
    may have been written in two ticks: both are then of the manifest's tick or later); returns the horizon."""
    times = [os.stat(out / rel).st_mtime_ns for rel in FILES["rollout"].values()]
    when = max(times) + delta_ns if delta_ns else min(times)
    os.utime(out / "manifest.jsonl", ns=(when, when))
    horizon = stat_horizon(out)
    assert horizon == when
    return horizon


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The files damage() reads."""
    seen: list[str] = []
    real = integrity._file_digest

    def spy(path: str):
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(integrity, "_file_digest", spy)
    return seen


def test_records_size_digest_and_mtime(run) -> None:
    out, rec = run
    for rel, want in rec["checksums"].items():
        st = os.stat(out / rel)
        assert want["bytes"] == st.st_size and want["mtime_ns"] == st.st_mtime_ns
        assert want == {**integrity.checksum((out / rel).read_bytes()), "mtime_ns": st.st_mtime_ns}


def test_untouched_files_are_trusted_unread(run, hashed) -> None:
    out, rec = run
    assert damage(rec, out, _settle(out)) is None and hashed == []


def test_files_of_the_manifests_tick_are_hashed(run, hashed) -> None:
    """A coarse file clock keeps the mtime of a same-size rewrite in the write's tick: such files are
    hashed, and a rewrite with the recorded mtime is found."""
    out, rec = run
    horizon = _settle(out, 0)
    assert damage(rec, out, horizon) is None and sorted(hashed) == ["a.png.rollout.npy", "a.png.rollout.png"]
    assert damage(rec, out, None) is None  # no manifest: every file is hashed
    maps = out / FILES["rollout"]["maps"]
    mtime = maps.stat().st_mtime_ns
    maps.write_bytes(bytes(reversed(range(256))) * 4)
    os.utime(maps, ns=(mtime, mtime))  # as a rewrite within the same clock tick leaves it
    assert damage(rec, out, horizon) == CHANGED


def test_same_size_rewrite_with_a_new_mtime_is_hashed_and_found(run, hashed) -> None:
    out, rec = run
    horizon = _settle(out)
    maps = out / FILES["rollout"]["maps"]
    maps.write_bytes(bytes(reversed(range(256))) * 4)
    os.utime(maps, ns=(5, 5))
    assert damage(rec, out, horizon) == CHANGED
    assert hashed == ["a.png.rollout.npy"]
    # the same content back (a new mtime still): hashed and trusted, its new mtime handed back to be recorded
    maps.write_bytes(bytes(range(256)) * 4)
    os.utime(maps, ns=(7, 7))
    fresh: dict = {}
    assert damage(rec, out, horizon, fresh) is None
    assert fresh == {FILES["rollout"]["maps"]: {**rec["checksums"][FILES["rollout"]["maps"]], "mtime_ns": 7}}
    hashed.clear()
    assert damage({**rec, "checksums": {**rec["checksums"], **fresh}}, out, horizon) is None and hashed == []


def test_size_missing_and_link_found_unread(run, hashed) -> None:
    out, rec = run
    horizon = _settle(out)
    figure = out / FILES["rollout"]["figure"]
    data = figure.read_bytes()
    figure.write_bytes(data[:-1])
    want = f"damaged: {len(data) - 1} bytes, the run wrote {len(data)}"
    assert damage(rec, out, horizon) == (FILES["rollout"]["figure"], want)
    figure.unlink()
    assert damage(rec, out, horizon) == (FILES["rollout"]["figure"], "missing (or not a regular file)")
    (out / "elsewhere.png").write_bytes(data)
    figure.symlink_to(out / "elsewhere.png")
    assert damage(rec, out, horizon) == (FILES["rollout"]["figure"], "missing (or not a regular file)")
    assert hashed == []


def test_an_older_versions_record_is_only_checked_for_presence(run, hashed) -> None:
    out, rec = run
    old = {"files": rec["files"]}
    assert not has_checksums(old) and has_checksums(rec)
    (out / FILES["rollout"]["maps"]).write_bytes(b"anything")
    assert damage(old, out, None) is None and hashed == []
    (out / FILES["rollout"]["maps"]).unlink()
    assert damage(old, out, None) == (FILES["rollout"]["maps"], "missing (or not a regular file)")
