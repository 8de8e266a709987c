"""The output folder before and around a run: usable (:func:`check_writable`), no folder where
the run writes its own files (:func:`check_own_names`), and the temporary files a killed run
left behind removed (:func:`clean_stale_temps`)."""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path

from ..errors import UsageError
from ..files import TEMP_RE, folder_tag

__all__ = ["check_writable", "check_own_names", "clean_stale_temps", "is_run_summary"]


def check_writable(out: str | os.PathLike[str], what: str = "") -> None:
    """Refuse an output folder that cannot be used, before any model is loaded.

    ``out`` may not exist yet (it is created later; nothing is created here): then its
    nearest existing parent must be a writable folder. A probe file is created and removed
    (so a read-only file system or a folder without write permission is found even when
    the permission bits say otherwise).

    Args:
        out: the folder.
        what: how messages name it (default ``--out 'OUT'``).

    Raises:
        UsageError: ``out`` is empty, a dangling symlink, a file, or not writable.
    """
    text = os.fspath(out)
    if not text:  # (the current folder to os.path: the outputs would land among whatever is there)
        raise UsageError("--out is empty; name the output folder (e.g. --out maps)")
    what = what or f"--out {text!r}"
    if os.path.islink(text) and not os.path.exists(text):
        raise UsageError(f"{what} is a symbolic link to {os.readlink(text)!r}, which does not exist; "
                         "create the target folder or choose another --out")
    if os.path.exists(text) and not os.path.isdir(text):
        raise UsageError(f"{what} exists and is not a folder")
    probe_in = os.path.abspath(text)
    while not os.path.exists(probe_in):
        parent = os.path.dirname(probe_in)
        if parent == probe_in:
            break
        probe_in = parent
    if not os.path.isdir(probe_in):
        raise UsageError(f"{what}: {probe_in!r} is not a folder, so the output folder cannot be created there")
    probe = os.path.join(probe_in, f".{uuid.uuid4().hex[:12]}.{os.getpid()}.tmp")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
    except OSError as e:
        where = "" if probe_in == os.path.abspath(text) else f" (its folder {probe_in!r})"
        raise UsageError(f"{what}{where} is not writable: {e.strerror or e}; choose another --out") from None
    try:
        os.unlink(probe)
    except OSError:
        pass


def is_run_summary(path: str) -> bool:
    """Whether ``path`` is a regular file holding a batch run's ``summary.json`` (a JSON object
    naming vitexplain's version)."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > (256 << 20):  # (no summary of ours is that large)
            return False
        with open(path, "rb") as f:
            summary = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return False
    versions = summary.get("versions") if isinstance(summary, dict) else None
    return isinstance(versions, dict) and "vitexplain" in versions


def _written_by_us(path: str, name: str) -> bool:
    """Whether the regular file ``path`` (the run's ``name``: ``manifest.jsonl``, ``summary.json``,
    ``index.html``) looks like a batch run's own (any other name: True).

    A manifest's lines start with its ``"key"``; a summary is a JSON object naming vitexplain's
    version; a gallery's title starts with ``vitexplain``. An empty file holds nothing to lose.
    """
    try:
        with open(path, "rb") as f:
            if name == "manifest.jsonl":
                head = f.read(1 << 16).lstrip()
                return not head or head.startswith(b'{"key":')
            if name == "summary.json":
                return not f.read(1 << 10).strip() or is_run_summary(path)
            if name == "index.html":
                head = f.read(4096)
                return not head.strip() or b"<title>vitexplain" in head
    except (OSError, ValueError):  # unreadable: the run's own write will say what is wrong
        return name != "summary.json"
    return True


def check_own_names(out: str | os.PathLike[str], names: list[str]) -> None:
    """Refuse an output folder where one of the run's own files (``names``, at its top) is
    taken by something other than a file (a folder, a socket...), or by a file another program
    wrote (a dataset's ``manifest.jsonl``, a web page's ``index.html``: the run would replace it),
    before any model is loaded. A symbolic link there is replaced, its target untouched.

    Raises:
        UsageError: names the entry and what to do.
    """
    for name in names:
        path = os.path.join(out, name)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue  # missing (or --out missing): the run creates it
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise UsageError(f"--out {os.fspath(out)!r} holds {kind} named {name!r}, where the run writes its own "
                             f"{name}; rename or remove it, or choose another --out")
        if stat.S_ISREG(mode) and not _written_by_us(path, name):
            raise UsageError(f"--out {os.fspath(out)!r} holds a {name} not written by vitexplain, which the run would "
                             "replace with its own; move it, or choose another --out (e.g. a new folder)")


def clean_stale_temps(out: Path, *, everywhere: bool) -> int:
    """Remove temporary files (:data:`TEMP_RE`) left in ``out`` by killed runs into ``out``.

    Call it only while holding the output lock (no other run writes into ``out`` then). Only
    temporaries tagged with ``out``'s own :func:`~vitexplain.files.folder_tag` are removed: a live
    run whose ``--out`` is a folder below ``out``, or holds ``out``, writes temporaries tagged with
    its own folder, under its own lock, and they are left alone (removing one made that run's
    write fail). Temporaries of another folder's killed run are that folder's next run's to remove.

    Args:
        out: the output folder.
        everywhere: look in every folder below ``out`` (a run was killed: it left its manifest
            part behind); otherwise only in ``out`` itself, where the summary and manifest are
            written after the parts are merged and removed.

    Returns:
        How many files were removed.
    """
    removed = 0
    tag = folder_tag(out)
    walk = os.walk(out) if everywhere else [(str(out), [], os.listdir(out))]
    for dirpath, _, files in walk:
        for name in files:
            m = TEMP_RE.match(name)
            if m and m.group(1) == tag:
                try:
                    os.unlink(os.path.join(dirpath, name))
                    removed += 1
                except OSError:
                    pass
    return removed
