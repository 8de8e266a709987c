"""Walking the inputs: folders (recursively, symbolic links to folders followed once) and glob
patterns (a ``**`` one matched while walking), skipping hidden entries, ``--out`` and the output
folders of earlier runs (a folder holding a run's ``summary.json``); folders that cannot be listed
are collected (:class:`Unreadable`). :mod:`vitexplain.batch.inputs` turns what is found into keys.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from dataclasses import dataclass
from typing import Iterable

from .outfolder import is_run_summary

__all__ = ["IMAGE_EXTENSIONS", "Unreadable", "inside", "is_image_name", "glob_base", "walk", "recursive_glob",
           "pattern_parts", "below_earlier_output"]

#: File extensions (lower case) picked up when walking folders or expanding globs. A file
#: named explicitly on the command line is tried whatever its extension.
IMAGE_EXTENSIONS: frozenset[str] = frozenset(
    {".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".bmp", ".gif", ".tif", ".tiff", ".webp",
     ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".ico"}
)


@dataclass(frozen=True)
class Unreadable:
    """A folder that could not be listed (its images, if any, are missing from the run).

    Attributes:
        path: the folder.
        error: the reason (e.g. ``"Permission denied"``).
    """

    path: str
    error: str


def inside(path: str, folder: str) -> bool:
    """Whether real path ``path`` is ``folder`` or below it (both already realpath'd)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def glob_base(pattern: str) -> str:
    """The fixed folder prefix of a glob pattern (``a/b/*/c*.png`` -> ``a/b``)."""
    drive, rest = os.path.splitdrive(pattern)
    parts = re.split(r"[\\/]", rest) if os.altsep else rest.split(os.sep)
    fixed: list[str] = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    if not fixed:
        return drive or "."
    return drive + (os.sep.join(fixed) or os.sep)


def _is_earlier_output(folder: str) -> bool:
    """Whether ``folder`` holds the ``summary.json`` a batch run writes at the top of its ``--out``."""
    return is_run_summary(os.path.join(folder, "summary.json"))


def below_earlier_output(path: str, base: str, earlier: list[str], checked: dict[str, bool]) -> bool:
    """Whether a folder between ``base`` (excluded) and the file ``path`` is an earlier run's output
    (added to ``earlier``); ``checked`` caches the answer per folder."""
    folder, below = os.path.dirname(path), False
    base_abs = os.path.abspath(base)
    while folder and os.path.abspath(folder) != base_abs and inside(os.path.abspath(folder), base_abs):
        if folder not in checked:
            checked[folder] = _is_earlier_output(folder)
            if checked[folder]:
                earlier.append(folder)
        below = below or checked[folder]
        folder = os.path.dirname(folder)
    return below


def pattern_parts(pattern: str) -> list[str]:
    """The components of a path pattern, without empty and ``.`` ones."""
    rest = os.path.splitdrive(pattern)[1]
    parts = re.split(r"[\\/]", rest) if os.altsep else rest.split(os.sep)
    return [p for p in parts if p not in ("", ".")]


def _parts_match(patterns: list[str], names: list[str]) -> bool:
    """Whether path components ``names`` match pattern components (``**``: any number of them)."""
    if not patterns:
        return not names
    if patterns[0] == "**":
        return any(_parts_match(patterns[1:], names[i:]) for i in range(len(names) + 1))
    return bool(names) and fnmatch.fnmatch(names[0], patterns[0]) and _parts_match(patterns[1:], names[1:])


def recursive_glob(pattern: str, out_real: str, unreadable: list[Unreadable], earlier: list[str]) -> list[str]:
    """The images a pattern with a ``**`` component matches, found without ``glob``'s recursion
    (which follows a link loop until the path is too long, listing a file dozens of times, and with
    two such links never ends).

    The part before the first ``**`` is expanded by ``glob`` (one level per component); each folder
    it gives is walked as a folder argument is (a symbolic link to a folder followed once), and an
    image is taken when the rest of the pattern matches its path below that folder, or the path of
    one of its folders there (a matched folder gives all its images, as ``glob`` then walking it did).
    """
    drive, rest = os.path.splitdrive(pattern)
    raw = re.split(r"[\\/]", rest) if os.altsep else rest.split(os.sep)
    i = raw.index("**")
    head = drive + (os.sep.join(raw[:i]) or (os.sep if i else ""))
    tail = [p for p in raw[i:] if p not in ("", ".")]
    folders = sorted(glob.glob(head)) if glob.has_magic(head) else [head or "."]
    found = []
    for folder in folders:
        if not os.path.isdir(folder):
            continue
        for path in walk(folder, out_real, unreadable, earlier):
            names = pattern_parts(os.path.relpath(path, folder))
            if any(_parts_match(tail, names[:k]) for k in range(len(names) + 1)):
                found.append(path if head else os.path.relpath(path, folder))  # ('**/*.png': a.png, as glob)
    return found


def walk(folder: str, out_real: str, unreadable: list[Unreadable], earlier: list[str]) -> Iterable[str]:
    """Image files below ``folder``, sorted, skipping hidden entries, the output folder and the
    output folders of earlier runs (added to ``earlier``).

    Symlinked folders are followed once (loops are cut by device/inode); a folder that
    cannot be listed is added to ``unreadable``.
    """
    seen: set[tuple[int, int]] = set()
    stack = [folder]
    while stack:
        top = stack.pop()
        try:
            st = os.stat(top)
            ident = (st.st_dev, st.st_ino)
            if ident in seen:
                continue
            seen.add(ident)
            with os.scandir(top) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            unreadable.append(Unreadable(path=top, error=e.strerror or str(e)))
            continue
        subdirs = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                if inside(os.path.realpath(entry.path), out_real):  # never read our own outputs back
                    continue
                if _is_earlier_output(entry.path):  # nor another run's
                    earlier.append(entry.path)
                    continue
                subdirs.append(entry.path)
            elif is_image_name(entry.name):
                if not (entry.is_symlink() and inside(os.path.realpath(entry.path), out_real)):
                    yield entry.path
        stack.extend(reversed(subdirs))
