"""What a resumed run may trust: every output file as the run that recorded it wrote it.

Each image's write job writes through a :class:`RecordingWriter`, which notes every file's size,
BLAKE2b digest and modification time once it is in place; the image's manifest record keeps them
(``"checksums": {path relative to OUT: {"bytes": n, "blake2b": 32 hex, "mtime_ns": t}}``). On
resume, an image counts as current only when each of its files is still as written (:func:`damage`):

- missing, not a regular file, or reached through a link: redone;
- another size (an overlay cut short by a copy, an emptied JSON): redone, without reading it;
- the recorded size and ``mtime_ns`` (the file clock's value, set by any write): trusted without
  reading it, provided the manifest was written in a later tick of the file clock (its
  ``manifest.jsonl`` is newer than the file: see below);
- otherwise (same size, another mtime -- a map overwritten in place -- or a file written in the
  manifest's own clock tick): read and hashed, and its digest decides.

Damaged images are redone, and the run says so (in its log and in ``summary.json``'s
``damaged_outputs``). So resuming an untouched run reads no output file: it only stats them.

Why the manifest's tick: a file clock is coarse (a few ms on Linux, 1-2 s on FAT or some network
file systems), so a same-size rewrite in the tick of the original write keeps its mtime. Every
later change happens after the manifest was written, hence in a tick not earlier than the manifest's;
a file whose recorded mtime is older than the manifest's cannot be rewritten with that mtime (as
git treats "racily clean" index entries). Files of the manifest's own tick are hashed. (A change made by
another program while the run was still writing, in the very tick of the file's write, is not seen.)

Blind spot: a same-size rewrite that also restores the recorded mtime (``touch -d``, ``cp -p`` or
``rsync -t`` of another file of the same size and time, ``os.utime``) is trusted; ``--overwrite``
redoes everything.

Records written by an older version carry no checksums: they are trusted as that version did
(every listed file present as a regular file reached without links); the run counts them
(``unverified_outputs``) and says once how to redo them (``--overwrite``). Records with checksums but
without ``mtime_ns`` (the version just before) have their files hashed once (then their mtimes are recorded,
below).

A file read and found as written under another mtime (an output folder copied without its times) has its
new mtime recorded (the image's record is appended again, its checksums refreshed): it is read once, not on
every resume.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any, Optional

from ..files import Writer, is_output_file
from .manifest import MANIFEST

__all__ = ["RecordingWriter", "checksum", "damage", "has_checksums", "stat_horizon"]

_CHUNK = 1 << 20


def checksum(data: bytes) -> dict[str, Any]:
    """``{"bytes": len(data), "blake2b": 32 hex digits}`` of a file's content."""
    return {"bytes": len(data), "blake2b": hashlib.blake2b(data, digest_size=16).hexdigest()}


class RecordingWriter:
    """``writer.write`` for one image's write job, noting each file's :func:`checksum` in ``sums``.

    Args:
        writer: the run's (thread-safe) writer.
        sums: ``{rel: checksum}``, filled as files are written.
    """

    def __init__(self, writer: Writer, sums: dict[str, dict[str, Any]]) -> None:
        self.writer, self.sums = writer, sums
        self.out = writer.out
        self._lock = threading.Lock()

    def write(self, rel: str, data: bytes) -> None:
        """Write ``data`` to ``OUT/rel`` (:meth:`Writer.write`) and note its checksum and modification
        time once it is in place (without one, when the file cannot be stat'ed: resume hashes it)."""
        self.writer.write(rel, data)
        sums = checksum(data)
        try:
            sums["mtime_ns"] = int(os.stat(os.path.join(self.out, *rel.split("/")), follow_symlinks=False).st_mtime_ns)
        except OSError:  # pragma: no cover - removed meanwhile by someone else
            pass
        with self._lock:
            self.sums[rel] = sums


def _file_digest(path: str) -> str:
    """The file's BLAKE2b digest as :func:`checksum` gives it (32 hex digits), read in chunks."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def has_checksums(rec: dict[str, Any]) -> bool:
    """Whether a record carries checksums (records of versions before them do not)."""
    return isinstance(rec.get("checksums"), dict)


def stat_horizon(out: Path | str) -> Optional[int]:
    """The ``mtime_ns`` of ``OUT/manifest.jsonl`` (None without one): a file whose recorded mtime is older
    is trusted by its size and mtime (see the module docstring)."""
    try:
        return int(os.stat(os.path.join(out, MANIFEST)).st_mtime_ns)
    except OSError:
        return None


def damage(rec: dict[str, Any], out: Path, horizon: Optional[int] = None,
           fresh: Optional[dict[str, dict[str, Any]]] = None) -> Optional[tuple[str, str]]:
    """Why the output files of an ok record cannot be trusted, or None when each is as written.

    A file is read (and hashed) only when its size is as recorded but its mtime is not, or is not
    older than ``horizon`` (the rule is in the module docstring). A record without checksums (an older
    version's) is only checked for its files' presence, as that version did.

    Args:
        rec: the image's manifest record (``files`` and ``checksums``).
        out: the output folder.
        horizon: :func:`stat_horizon` of ``out``; None hashes every file of the right size.
        fresh: filled with ``{file: checksum with its mtime now}`` for the files read and found as written
            under another mtime (a copy's): the driver records them, so the next resume trusts them by stat.

    Returns:
        ``(file, reason)``: the first file (relative to ``out``) that is missing, reached through a link,
        of another size or content than recorded, or unreadable, or that has no recorded checksum
        (in a record with checksums).
    """
    sums = rec.get("checksums")
    files = [str(rel) for entry in (rec.get("files") or {}).values() if isinstance(entry, dict)
             for rel in entry.values()]
    for rel in files:
        if not is_output_file(out, rel):
            return rel, "missing (or not a regular file)"
        if not isinstance(sums, dict):
            continue  # an older version's record: present is all it can tell
        want = sums.get(rel)
        if not isinstance(want, dict):
            return rel, "no checksum recorded for this file: cannot be verified"
        path = os.path.join(out, *rel.split("/"))
        try:
            st = os.stat(path)
            if st.st_size != want.get("bytes"):
                return rel, f"damaged: {st.st_size} bytes, the run wrote {want.get('bytes')}"
            mtime = want.get("mtime_ns")
            if isinstance(mtime, int) and st.st_mtime_ns == mtime and horizon is not None and mtime < horizon:
                continue  # as written, and the manifest is younger than any same-tick rewrite
            if _file_digest(path) != want.get("blake2b"):
                return rel, "damaged: its content differs from what the run wrote"
            if fresh is not None and st.st_mtime_ns != mtime:
                fresh[rel] = {**want, "mtime_ns": int(st.st_mtime_ns)}
        except OSError as e:
            return rel, f"unreadable ({e.strerror or e})"
    return None
