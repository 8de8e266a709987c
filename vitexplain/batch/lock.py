"""One run at a time per output folder: ``OUT/.vitexplain.lock``.

Two runs writing into one ``--out`` at once would interleave their manifests and clean up
each other's files, so a run holds an exclusive lock on ``OUT/.vitexplain.lock`` from before
its first write until after its summary. A second run finds the lock held and stops with a
usage error naming the holder (pid, host, command, start time). Under ``torchrun`` rank 0
holds the lock for the whole run.

The lock is a POSIX record lock (``fcntl.lockf``, ``F_SETLK``; ``msvcrt.locking`` on
Windows). The operating system releases it when its process dies, and, unlike ``flock``, a
record lock belongs to the process alone: a child forked while it is held (a DataLoader
worker) does not hold it, so a killed run (``kill -9``, a crash, a lost node) never blocks
the next one, even while its workers linger. The file may still be there; nobody holds it.
A record lock is also dropped when its process closes *any* descriptor of the file, so this
process never opens the lock file of a folder it holds a second time: a second lock of the
same folder in the same process is refused from memory.

The lock file is opened with ``O_NOFOLLOW`` and must be a regular file with no other name: a
symbolic or hard link planted as ``OUT/.vitexplain.lock`` is refused (a usage error), so its
target is never truncated or written.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from ..errors import UsageError

__all__ = ["LOCK_NAME", "OutputLock", "FolderBusyError"]

LOCK_NAME = ".vitexplain.lock"

_OPEN = (os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
         | getattr(os, "O_NONBLOCK", 0))  # O_NONBLOCK: a FIFO planted there must not hang the open

# the folders this process holds: (st_dev, st_ino) -> the holder's info
_HELD: dict[tuple[int, int], dict[str, Any]] = {}
_HELD_LOCK = threading.Lock()


class FolderBusyError(UsageError):
    """Another live run holds the output folder."""


def _try_lock(fd: int) -> bool:
    if sys.platform == "win32":  # pragma: no cover - Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    import fcntl

    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise


def _describe(info: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info.get("started", 0))))
    return f"pid {info.get('pid')} on {info.get('host')}, `{info.get('command')}`, since {when}"


def _holder(path: Path) -> str:
    try:
        return _describe(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, AttributeError):
        return "another process"


def _busy(folder: Path, holder: str) -> FolderBusyError:
    return FolderBusyError(
        f"--out {str(folder)!r} is in use by another vitexplain run ({holder}); wait for it to finish, or "
        "choose another --out. Two runs writing into one folder at once would mix their manifests"
    )


class OutputLock:
    """The exclusive lock of one output folder (acquire, then release; also a context manager).

    Args:
        out: the output folder (must exist).
        command: what holds it (shown to a second run), e.g. ``"vitexplain export"``.
    """

    def __init__(self, out: Path, command: str) -> None:
        self.path = Path(out) / LOCK_NAME
        self.command = command
        self._fd: Optional[int] = None
        self._key: Optional[tuple[int, int]] = None

    def acquire(self) -> "OutputLock":
        """Take the lock.

        Raises:
            FolderBusyError: another live run (of this process or another) holds it.
            UsageError: the lock file is a link or not a regular file (planted by something else).
            OSError: the lock file cannot be created (the folder is not writable).
        """
        st = os.stat(self.path.parent)
        key = (st.st_dev, st.st_ino)
        with _HELD_LOCK:
            if key in _HELD:  # held by this process: never open the file again (that would drop the lock)
                raise _busy(self.path.parent, _describe(_HELD[key]))
            for _ in range(10):
                fd = self._open()
                if not _try_lock(fd):
                    os.close(fd)
                    raise _busy(self.path.parent, _holder(self.path))
                try:  # the holder we raced with may have removed the file after we opened it
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    self._fd, self._key = fd, key
                    _HELD[key] = self._write_info()
                    return self
                os.close(fd)
        raise FolderBusyError(f"could not lock {self.path}: it keeps being replaced by another process")

    def _open(self) -> int:
        """Open (create) the lock file, refusing links and anything but a plain file with one name."""
        try:
            fd = os.open(self.path, _OPEN, 0o666)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EMLINK) or self.path.is_symlink():
                raise UsageError(self._planted("is a symbolic link")) from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else "has other names (a hard link)"
            raise UsageError(self._planted(what))
        return fd

    def _planted(self, what: str) -> str:
        return (f"{str(self.path)!r} {what}; vitexplain only ever makes a plain file there, so it was put there "
                "by something else and is left alone (writing the lock through it would overwrite another "
                "file). Remove it, or choose another --out")

    def _write_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                                "started": time.time()}
        data = (json.dumps(info) + "\n").encode("utf-8")
        if self._fd is None:
            raise UsageError("the output lock is not held (write its info only while holding it)")
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, data)
        return info

    def release(self) -> None:
        """Remove the lock file and release the lock (no-op when not held)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still holding it: a waiting run re-checks the inode
        except OSError:
            pass
        with _HELD_LOCK:
            os.close(self._fd)
            _HELD.pop(self._key, None)  # type: ignore[arg-type]
        self._fd = self._key = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
