"""What a resumed run may trust: every output file as the run that recorded it wrote it.

Each image's write job writes through a :class:`RecordingWriter`, which notes every file's size
and BLAKE2b digest; the image's manifest record keeps them (``"checksums": {path relative to
OUT: {"bytes": n, "blake2b": 32 hex}}``). On resume, an image counts as current only when each of
its files still has that size and digest (:func:`damage`): an overlay cut short by a copy, a map
overwritten in place, an emptied JSON -- each is found, and the image is redone (and the run
says so, in its log and in ``summary.json``'s ``damaged_outputs``). A record without checksums
(written by an older version) cannot be verified and is redone too.

Cost: resuming reads every output file it skips once (the original run wrote them all).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any, Optional

from ..files import Writer, is_output_file

__all__ = ["RecordingWriter", "checksum", "damage"]

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
        """Write ``data`` to ``OUT/rel`` (:meth:`Writer.write`) and note its checksum once it is in place."""
        self.writer.write(rel, data)
        sums = checksum(data)
        with self._lock:
            self.sums[rel] = sums


def _file_sum(path: str) -> dict[str, Any]:
    h = hashlib.blake2b(digest_size=16)
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, "blake2b": h.hexdigest()}


def damage(rec: dict[str, Any], out: Path) -> Optional[tuple[str, str]]:
    """Why the output files of an ok record cannot be trusted, or None when each is as written.

    Args:
        rec: the image's manifest record (``files`` and ``checksums``).
        out: the output folder.

    Returns:
        ``(file, reason)``: the first file (relative to ``out``) that is missing, reached through a link,
        of another size or content than recorded, or unreadable, or that has no recorded checksum.
    """
    sums = rec.get("checksums")
    files = [str(rel) for entry in (rec.get("files") or {}).values() if isinstance(entry, dict)
             for rel in entry.values()]
    for rel in files:
        if not is_output_file(out, rel):
            return rel, "missing (or not a regular file)"
        want = sums.get(rel) if isinstance(sums, dict) else None
        if not isinstance(want, dict):
            return rel, "no checksum recorded (written by an older version): cannot be verified"
        path = os.path.join(out, *rel.split("/"))
        try:
            size = os.stat(path).st_size
            if size != want.get("bytes"):
                return rel, f"damaged: {size} bytes, the run wrote {want.get('bytes')}"
            if _file_sum(path)["blake2b"] != want.get("blake2b"):
                return rel, "damaged: its content differs from what the run wrote"
        except OSError as e:
            return rel, f"unreadable ({e.strerror or e})"
    return None
