"""Writing output files: atomically, as valid UTF-8, and failing loudly when the disk does.

Used by everything that writes files (the batch commands, the gallery, the explorer page,
``vx.viz.save_png``), so it sits low in the package and knows no command.

Every file is written to a hidden temporary name in its destination folder
(``.vx-<folder tag>-<12 hex>.<pid>.tmp``, :data:`TEMP_RE`, created with ``O_EXCL``) and moved
into place with :func:`os.replace`, so an interrupted run leaves no half-written file; a run
killed outright (``kill -9``) can leave a temporary file, which the next run into the same
output folder removes under the output lock (:func:`~vitexplain.batch.outfolder.clean_stale_temps`).
The folder tag (:func:`folder_tag`) names the output folder the writer writes below, so that
clean-up removes only the temporaries of runs into *its* folder: another run whose ``--out`` is
nested inside it (or holds it) is live under its own lock, and its temporaries are left alone.

Links planted in the output folder never redirect a write: the folders below ``--out`` are
opened one by one relative to their parent with ``O_NOFOLLOW`` (``openat``), so a subfolder that
is a symbolic link fails that image's files (:class:`LinkError`) instead of sending them outside
``--out``; a file name that is a link (``manifest.jsonl`` -> ``/etc/passwd``) is replaced by the
rename, never written through. ``--out`` itself may be a link to a folder.

An error writing a file is either about that one image (a name the file system refuses:
``ENAMETOOLONG``, ``EINVAL``, ``EILSEQ``, a file where a folder should be) -- the image fails,
the run goes on -- or about the output folder (a full disk, a quota, an I/O error, a
read-only or vanished folder): :class:`OutputError`, which ends the run with exit status
:data:`~vitexplain.batch.run.EXIT_OUTPUT`.

JSON is written as UTF-8 whatever the file names: a string holding bytes that are not UTF-8
(Python's surrogate escapes, from a file name) is written with those bytes as ``\\xNN``
(``os.fsencode`` + ``backslashreplace``), see :func:`json_safe`.
"""

from __future__ import annotations

import errno
import io
import itertools
import json
import os
import re
import stat
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from .errors import UsageError, VitexplainError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

__all__ = [
    "OutputError",
    "LinkError",
    "Writer",
    "write_file",
    "write_user_file",
    "check_file_path",
    "open_folder",
    "is_output_file",
    "WriteFn",
    "TEMP_RE",
    "folder_tag",
    "encode_png",
    "encode_npy",
    "encode_npz",
    "json_safe",
    "json_bytes",
    "is_per_file",
]

#: Temporary file names written by :class:`Writer` (``.vx-<8 hex folder tag>-<12 hex>.<pid>.tmp``);
#: group 1 is the tag of the output folder they were written below (:func:`folder_tag`).
TEMP_RE = re.compile(r"^\.vx-([0-9a-f]{8})-[0-9a-f]{12}\.\d+\.tmp$")


def folder_tag(folder: Path | str) -> str:
    """8 hex digits naming the folder ``folder`` (from its inode number: the same on every host that
    mounts it and under every path that reaches it), which :class:`Writer` puts in its temporary file
    names so that clean-up can tell the temporaries of runs into one output folder from another's.

    Raises:
        OSError: ``folder`` cannot be stat'ed.
    """
    return f"{os.stat(folder).st_ino & 0xFFFFFFFF:08x}"

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
#: openat() with a folder descriptor is available (POSIX); elsewhere each folder is lstat'ed
_AT = os.open in os.supports_dir_fd and os.rename in os.supports_dir_fd and os.mkdir in os.supports_dir_fd  # os.replace is renameat too

# errors about one file's name or place: that image fails, the run goes on
_PER_FILE = frozenset({errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ, errno.EEXIST, errno.ENOTDIR, errno.EISDIR,
                       errno.ELOOP})


class OutputError(VitexplainError, OSError):
    """The output folder cannot be written (full disk, quota, I/O error, read-only): the run ends.

    Attributes:
        errno: the operating system's error number (e.g. ``errno.ENOSPC``).
    """


class LinkError(VitexplainError, OSError):
    """A folder below the output folder is a symbolic link: nothing is written through it."""


def is_per_file(error: OSError) -> bool:
    """Whether a write error concerns one file's name or place rather than the output folder."""
    return error.errno in _PER_FILE


def _output_error(path: str, error: OSError) -> OSError:
    if isinstance(error, OutputError) or is_per_file(error):
        return error
    reason = error.strerror or str(error) or type(error).__name__
    return OutputError(error.errno, f"cannot write {path}: {reason}")


class Writer:
    """Atomic file writes below an output folder (thread-safe), never through a link.

    Args:
        out: the output folder.
    """

    def __init__(self, out: Path | str) -> None:
        self.out = Path(out)
        self._prefix = os.urandom(3).hex()
        self._count = itertools.count()
        self._tag: Optional[str] = None  # folder_tag(out), once out exists

    def write(self, rel: str, data: bytes) -> None:
        """Write ``data`` to ``out/rel`` (``rel``: posix path) via a temporary file; the folders
        of ``rel`` are created.

        Raises:
            OutputError: the folder cannot be written (the run must end).
            LinkError: a folder of ``rel`` is a symbolic link (this image fails).
            OSError: this file's name or place is refused (this image fails).
        """
        *folders, name = rel.split("/")
        dest = os.path.join(self.out, *rel.split("/"))
        tmp: Optional[str] = None  # the temporary file, once created
        dir_fd = None
        try:
            dir_fd = open_folder(self.out, folders, create=True)
            if self._tag is None:
                self._tag = folder_tag(self.out)
            where = (lambda n: n) if _AT else (lambda n: os.path.join(self.out, *folders, n))
            at = {"dir_fd": dir_fd} if _AT else {}
            head = f".vx-{self._tag}-"
            candidate = f"{head}{self._prefix}{next(self._count) % 0x1000000:06x}.{os.getpid()}.tmp"
            try:
                fd = os.open(where(candidate), _CREATE, 0o666, **at)
            except FileExistsError:  # a leftover of a killed run with the same pid: another name
                candidate = f"{head}{uuid.uuid4().hex[:12]}.{os.getpid()}.tmp"
                fd = os.open(where(candidate), _CREATE, 0o666, **at)
            tmp = candidate
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            if _AT:
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            else:  # pragma: no cover - Windows
                os.replace(where(tmp), dest)
            tmp = None
        except OSError as e:
            raise _output_error(dest, e) from e
        finally:
            if tmp is not None:
                _unlink_quietly(tmp if _AT else os.path.join(self.out, *folders, tmp), dir_fd)
            if dir_fd is not None:
                os.close(dir_fd)


def write_file(path: Path | str, data: bytes) -> Path:
    """Write one file atomically (:meth:`Writer.write` in its folder, which is created); returns its path.

    Raises:
        OutputError: the folder cannot be written (full disk, read-only, ...).
        OSError: the name is refused (too long, a folder in the way).
    """
    dest = Path(path)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _output_error(str(dest), e) from e
    Writer(dest.parent).write(dest.name, data)
    return dest


def check_file_path(path: Any, what: str = "file") -> None:
    """Check, before any work, that ``path`` (given in Python) can name a file to write: a ``str`` or
    ``os.PathLike``, not a folder, and no file where one of its folders should be (missing folders are created
    when it is written).

    Raises:
        UsageError: it cannot.
    """
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise UsageError(f"the {what} to write must be a file path (str or pathlib.Path), got {path!r}")
    if os.path.isdir(path):
        raise UsageError(f"cannot write the {what} {os.fspath(path)!r}: it is a folder; pass the path of the file to write")
    for parent in Path(os.path.abspath(path)).parents:
        if os.path.exists(parent):
            if not os.path.isdir(parent):
                raise UsageError(f"cannot write the {what} {os.fspath(path)!r}: {str(parent)!r} is a file, not a "
                                 "folder; choose another folder")
            return


def write_user_file(path: Any, data: bytes, what: str = "file") -> Path:
    """:func:`write_file` for a path given in Python (``vx.viz.save_png``, ``vx.explore``): a name the file
    system refuses (a folder at ``path``, a file where one of its folders should be, a name too long) is a
    :class:`~vitexplain.errors.UsageError` saying so, not a bare ``OSError``.

    Raises:
        UsageError: ``path`` is not a path, or names something that cannot be written.
        OutputError: the folder cannot be written (full disk, read-only, ...).
    """
    check_file_path(path, what)
    try:
        return write_file(path, data)
    except VitexplainError:
        raise
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTDIR):
            why = "a file is in the way of its folder (a path below a file); choose another folder"
        else:
            why = f"{e.strerror or e}; choose another name or folder"
        raise UsageError(f"cannot write the {what} {os.fspath(path)!r}: {why}") from e


def open_folder(out: Path | str, folders: list[str], *, create: bool) -> Optional[int]:
    """A descriptor of the folder ``out/folders...`` opened without following a link below ``out``
    (``None`` where ``openat`` is not available: then each folder is checked with ``lstat``).

    Args:
        out: the output folder (itself may be a link).
        folders: the path below it, one name each.
        create: create missing folders.

    Raises:
        LinkError: one of ``folders`` is a symbolic link.
        OSError: a folder cannot be opened or created (``ENOTDIR``: a file is in the way).
    """
    if not _AT:  # pragma: no cover - Windows
        path = os.fspath(out)
        for i, part in enumerate(folders):
            path = os.path.join(path, part)
            if os.path.islink(path):
                raise _link_error(out, folders[: i + 1])
            if create and not os.path.isdir(path):
                os.makedirs(path, exist_ok=True)
        return None
    fd = os.open(out, _DIR)
    try:
        for i, part in enumerate(folders):
            try:
                sub = os.open(part, _DIR | NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:  # made meanwhile by another writer thread
                    pass
                sub = os.open(part, _DIR | NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR) and _is_link(part, fd):
                    raise _link_error(out, folders[: i + 1]) from None
                raise
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_output_file(out: Path | str, rel: str) -> bool:
    """Whether ``out/rel`` (posix ``rel``) is a regular file reached without a link below ``out``."""
    path = os.fspath(out)
    try:
        for part in rel.split("/"):
            path = os.path.join(path, part)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                return False
        return stat.S_ISREG(mode)
    except OSError:
        return False


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def _link_error(out: Path | str, folders: list[str]) -> LinkError:
    where = os.path.join(out, *folders)
    return LinkError(errno.ELOOP, f"{where} is a symbolic link inside --out; vitexplain never writes through "
                                  "links in its output folder (they could point anywhere). Remove the link, "
                                  "or choose another --out")


def _unlink_quietly(path: str, dir_fd: Optional[int] = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd) if dir_fd is not None and _AT else os.unlink(path)
    except OSError:
        pass


#: ``write(writer, files)``: writes one image's output files, adding each finished one to
#: ``files`` (``{group: {kind: path relative to OUT}}``, e.g. ``{"cdam": {"overlay": ...}}``).
WriteFn = Callable[[Writer, "dict[str, dict[str, str]]"], None]


def _png_params() -> list[int]:
    """Fast PNG settings for overlays: the ``AVG`` row filter with Huffman-only coding is ~7x
    faster than zlib level 1 with adaptive filters, and the files come out ~10% smaller."""
    import cv2

    params = [cv2.IMWRITE_PNG_COMPRESSION, 1, cv2.IMWRITE_PNG_STRATEGY, cv2.IMWRITE_PNG_STRATEGY_HUFFMAN_ONLY]
    if hasattr(cv2, "IMWRITE_PNG_FILTER"):  # OpenCV >= 4.11
        params += [cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FILTER_AVG]
    return params


_PNG_PARAMS: list[int] = []


def encode_png(rgb: "np.ndarray") -> bytes:
    """(H, W, 3) uint8 RGB -> PNG bytes.

    Raises:
        UsageError: OpenCV cannot encode the array.
    """
    import cv2
    import numpy as np

    if not _PNG_PARAMS:
        _PNG_PARAMS.extend(_png_params())
    ok, buf = cv2.imencode(".png", np.ascontiguousarray(rgb[..., ::-1]), _PNG_PARAMS)
    if not ok:  # pragma: no cover - OpenCV failure
        raise UsageError(f"OpenCV could not encode a PNG of this {rgb.shape} {rgb.dtype} array; "
                         "pass (H, W, 3) uint8 RGB")
    return buf.tobytes()


def encode_npy(array: "np.ndarray") -> bytes:
    """An array as float32 ``.npy`` bytes."""
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)
    return buf.getvalue()


def encode_npz(maps: "np.ndarray", tokens: list[str], ids: list[int]) -> bytes:
    """``maps`` (T, gh, gw) float32, ``tokens`` (T,) unicode, ``ids`` (T,) int64 as ``.npz`` bytes."""
    import numpy as np

    buf = io.BytesIO()
    np.savez(
        buf,
        maps=np.ascontiguousarray(maps, dtype=np.float32),
        tokens=np.asarray(list(tokens), dtype=np.str_),
        ids=np.asarray(list(ids), dtype=np.int64),
    )
    return buf.getvalue()


def _safe_char(ch: str) -> str:
    if "\udc80" <= ch <= "\udcff":  # an undecodable byte of a file name
        return f"\\x{ord(ch) - 0xDC00:02x}"
    if "\ud800" <= ch <= "\udfff":  # any other lone surrogate: its UTF-8 bytes
        return ch.encode("utf-8", "surrogatepass").decode("utf-8", "backslashreplace")
    return ch


def _safe_text(text: str) -> str:
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join(map(_safe_char, text))


def json_safe(value: Any) -> Any:
    """``value`` with every string made valid Unicode: undecodable file-name bytes (surrogate
    escapes ``\\udcNN``) become the text ``\\xNN``; other lone surrogates their UTF-8 bytes as ``\\xNN``.

    Dict keys, lists and tuples are converted recursively; other values are returned as they are.
    """
    if isinstance(value, str):
        return _safe_text(value)
    if isinstance(value, dict):
        return {json_safe(k) if isinstance(k, str) else k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_bytes(value: Any, *, indent: int | None = None) -> bytes:
    """JSON text of ``value`` (after :func:`json_safe`) as UTF-8 bytes, ending with a newline."""
    text = json.dumps(value, indent=indent, ensure_ascii=False, default=str) + "\n"
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # rare: a name with undecodable bytes somewhere in value
        return (json.dumps(json_safe(value), indent=indent, ensure_ascii=False, default=str) + "\n").encode("utf-8")
