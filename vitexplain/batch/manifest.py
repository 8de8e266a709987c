"""The manifest: one JSON line per image, written whole while the run goes, merged at the end.

While a run goes, each rank appends its records to its own part,
``OUT/manifest.part-<run id>-rank<r>.jsonl``: one ``write`` of one complete line
(``O_APPEND``), fsync'ed when the part is closed. A new run never appends to an old part, so a
line cut short by a crash or a full disk cannot glue itself to the next record. When every
rank is done, rank 0 merges the parts into ``OUT/manifest.jsonl`` (written atomically) and
removes the parts it merged.

Reading (:func:`read_jsonl`) repairs what a crash can leave: a torn last line is skipped, and
a line where a torn record was followed by a whole one (written by older versions, which
appended to one part per rank) gives back the whole record instead of losing both.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

from ..errors import UsageError
from ..files import OutputError, Writer, json_bytes

__all__ = ["MANIFEST", "SUMMARY", "GALLERY", "PART_RE", "ManifestPart", "new_run_id", "read_jsonl",
           "read_manifest", "merge_manifest"]

MANIFEST = "manifest.jsonl"
SUMMARY = "summary.json"
GALLERY = "index.html"
#: Manifest parts: this version's per-run parts and the per-rank parts of older versions.
PART_RE = re.compile(r"^manifest\.(?:part-[0-9a-f]+-)?rank\d+\.jsonl$")
_RECORD_START = re.compile(r'\{"key":')
# a new file each run (O_EXCL: never a planted link or an old part), appended whole lines
_PART_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


def new_run_id() -> str:
    """A fresh run id (12 hex digits) for part file names."""
    return uuid.uuid4().hex[:12]


class ManifestPart:
    """One rank's manifest part of one run: complete lines, one ``write`` each.

    Args:
        out: the output folder.
        run_id: the run's id (shared by its ranks).
        rank: this process's rank.
    """

    def __init__(self, out: Path, run_id: str, rank: int) -> None:
        self.path = Path(out) / f"manifest.part-{run_id}-rank{rank}.jsonl"
        try:
            self._fd: Optional[int] = os.open(self.path, _PART_FLAGS, 0o666)
        except OSError as e:
            raise OutputError(e.errno, f"cannot write {self.path}: {e.strerror or e}") from e

    def append(self, record: dict[str, Any]) -> None:
        """Append one record as one line.

        Raises:
            OutputError: the line could not be written (full disk, I/O error).
        """
        data = json_bytes(record)
        if self._fd is None:
            raise UsageError("this manifest part is closed; records are appended while the run holds it open")
        try:
            written = os.write(self._fd, data)
            while written < len(data):  # a short write (rare): finish the line
                written += os.write(self._fd, data[written:])
        except OSError as e:
            raise OutputError(e.errno, f"cannot write {self.path}: {e.strerror or e}") from e

    def close(self) -> None:
        """fsync and close (errors are ignored: every line was already handed to the OS)."""
        if self._fd is None:
            return
        try:
            os.fsync(self._fd)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _parse_line(text: str) -> Optional[dict[str, Any]]:
    try:
        rec = json.loads(text)
    except ValueError:
        # a torn record followed by a whole one on the same line: the last record start
        # from which the rest of the line parses is the whole one
        rec = None
        for m in reversed(list(_RECORD_START.finditer(text))):
            if m.start() == 0:
                break
            try:
                rec = json.loads(text[m.start():])
                break
            except ValueError:
                continue
    return rec if isinstance(rec, dict) and isinstance(rec.get("key"), str) else None


def read_jsonl(path: Path) -> Iterable[dict[str, Any]]:
    """The records of one manifest file (missing file: none); torn lines are repaired or skipped."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                rec = _parse_line(raw.decode("utf-8", "replace"))
                if rec is not None:
                    yield rec
    except FileNotFoundError:
        return


def _parts(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if PART_RE.match(p.name))


def read_manifest(out: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Latest record per key from ``manifest.jsonl`` and any unmerged parts.

    Parts are left by interrupted runs (or are being written by a running one); a record with
    a later ``time`` wins.

    Returns:
        ``{key: record}``.
    """
    return _latest([Path(out) / MANIFEST, *_parts(Path(out))])


def _latest(paths: list[Path]) -> dict[str, dict[str, Any]]:
    latest: dict[str, dict[str, Any]] = {}
    for path in paths:
        for rec in read_jsonl(path):
            old = latest.get(rec["key"])
            if old is None or _time(rec) >= _time(old):
                latest[rec["key"]] = rec
    return latest


def _time(rec: dict[str, Any]) -> float:
    try:
        return float(rec.get("time") or 0)
    except (TypeError, ValueError):
        return 0.0


def merge_manifest(out: Path, keys: set[str]) -> list[dict[str, Any]]:
    """Merge the parts into ``manifest.jsonl`` (rank 0, every rank done); returns its records.

    Kept: the latest record of each of this run's keys, plus earlier successful records of
    other inputs written into the same folder. The parts read are removed afterwards.

    Raises:
        OutputError: ``manifest.jsonl`` cannot be written (the parts are kept then).
    """
    parts = _parts(out)
    latest = _latest([out / MANIFEST, *parts])
    records = sorted((r for k, r in latest.items() if k in keys or r.get("status") == "ok"),
                     key=lambda r: r["key"])
    Writer(out).write(MANIFEST, b"".join(json_bytes(r) for r in records))
    for p in parts:
        p.unlink(missing_ok=True)
    return records
