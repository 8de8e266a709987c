"""Input discovery: files, folders and globs -> images with stable, safe output keys.

An image's **key** is its path relative to the input argument it was found under (a file
given directly: its name; a folder: the path below it; a glob: the path below the glob's
fixed prefix), with ``.``/``..``/empty components dropped, so outputs never leave ``--out``.
Its output files are ``OUT/<key>.<suffix>``. Keys are:

- **stable**: a function of the set of inputs, never of the order of the arguments. Keys
  that would collide are all told apart: under two roots (the same relative path), by the
  input folder's name before them, then by that name plus a hash of the folder's absolute
  path; within one root (names that differ only by case, or by undecodable bytes written
  ``%XX``), by a hash of the file's absolute path before the extension. The same file
  reached through two arguments is listed once, under its shortest key.
- **valid text**: bytes of a file name that are not UTF-8 (Python's surrogate escapes) are
  written ``%XX`` in the key, so every key (and manifest line) is valid UTF-8.
- **length-safe**: a name component longer than :data:`MAX_PART_BYTES` bytes (UTF-8) is cut
  and gets ``~`` + a 10-hex hash of the full name before its extension, leaving room for the
  longest output suffix within the usual 255-byte limit of file names.
- **collision-free with outputs**: a folder component that would be the name of an output
  file of its sibling (``x.png`` writes ``x.png.rollout.png``, so a folder
  ``x.png.rollout.png/`` would clash) or of a file at the top of ``--out`` (``summary.json``,
  ...) gets ``~`` + a hash.

An input lying inside ``--out`` is a usage error when the argument points there (a file, a
folder or a glob whose fixed prefix is inside ``--out``): each rerun would explain its own
overlays. While walking a folder or expanding a glob that contains ``--out``, ``--out`` is
skipped. Folders that cannot be read are collected (:class:`Unreadable`), not skipped
silently. A folder met while walking that holds the ``summary.json`` of an earlier run (the
``--out`` of another command, e.g. ``photos/maps`` after ``export photos --out photos/maps``)
is skipped too and listed in :attr:`InputScan.earlier_outputs`: a later run into another
``--out`` would otherwise explain those overlays as inputs. Named as an argument itself, such a
folder is walked.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import UsageError
from .walk import (IMAGE_EXTENSIONS, Unreadable, below_earlier_output, glob_base, inside, is_image_name, pattern_parts,
                   recursive_glob, walk)

__all__ = ["IMAGE_EXTENSIONS", "MAX_PART_BYTES", "InputItem", "Unreadable", "InputScan", "scan_inputs",
           "discover_inputs", "inside"]

#: Longest key component (bytes, UTF-8): 255 (the usual file-name limit) minus 64 bytes for
#: the longest output suffix (``.<method>.<ext>``).
MAX_PART_BYTES = 191

#: Names at the top of ``--out`` that a key's first folder may not take.
RESERVED_TOP = frozenset({"manifest.jsonl", "summary.json", "index.html", ".vitexplain.lock"})

#: Extensions of output files (``<key>.<method>.<ext>``, ``<key>.caption.json``).
OUTPUT_EXTENSIONS = frozenset({"png", "npy", "npz", "json", "jpg", "webp", "html"})


@dataclass(frozen=True)
class InputItem:
    """One image to export.

    Attributes:
        path: the file as found (as given, or joined below the folder given).
        key: its output key: posix path relative to ``--out``, without suffix.
    """

    path: str
    key: str


@dataclass
class InputScan:
    """What :func:`scan_inputs` found: the images (sorted by key), the unreadable folders and the
    folders skipped as earlier runs' outputs."""

    items: list[InputItem]
    unreadable: list[Unreadable] = field(default_factory=list)
    earlier_outputs: list[str] = field(default_factory=list)


def _hash(text: str, n: int = 8) -> str:
    return hashlib.sha1(os.fsencode(text) if text else b"").hexdigest()[:n]


def _text_part(part: str) -> str:
    """A name component as valid text: undecodable bytes (surrogate escapes) become ``%XX``."""
    if not any("\ud800" <= ch <= "\udfff" for ch in part):
        return part
    out = []
    for ch in part:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"%{code - 0xDC00:02X}")
        elif 0xD800 <= code <= 0xDFFF:  # a lone surrogate of a Windows name
            out.append(f"%u{code:04X}")
        else:
            out.append(ch)
    return "".join(out)


def _short_part(part: str, original: str) -> str:
    """Cut a component longer than MAX_PART_BYTES; ``~hash`` of the original before the extension."""
    if len(part.encode("utf-8")) <= MAX_PART_BYTES:
        return part
    stem, ext = os.path.splitext(part)
    if len(ext.encode("utf-8")) > 16:
        stem, ext = part, ""
    tag = "~" + _hash(original, 10)
    budget = MAX_PART_BYTES - len(ext.encode("utf-8")) - len(tag)
    cut = stem.encode("utf-8")[:budget].decode("utf-8", "ignore")
    return cut + tag + ext


def _key_parts(rel: str) -> list[str]:
    parts = re.split(r"[\\/]", rel) if os.altsep else rel.split(os.sep)
    return [_short_part(_text_part(p), p) for p in parts if p not in ("", ".", "..")]


def _refuse_inside_out(arg: str, where: str, out: str) -> UsageError:
    return UsageError(
        f"input {arg!r} is inside --out {out!r}: each run would explain its own outputs (and rerun "
        f"them); choose an --out outside the inputs (e.g. a sibling folder) or leave {where} out"
    )


def scan_inputs(inputs: Sequence[str], out: str | os.PathLike[str]) -> InputScan:
    """Expand input arguments into image items with unique, stable output keys.

    Args:
        inputs: files (any extension), folders (walked recursively for image extensions,
            hidden entries skipped) and glob patterns (``**`` recursive). A path that exists
            is taken literally even if it contains glob characters.
        out: the output folder: skipped while walking and matching; an argument inside it
            is refused.

    Returns:
        The items sorted by key and the folders that could not be listed.

    Raises:
        UsageError: an argument matches nothing or lies inside ``out``, or no image is found.
    """
    out_s = os.fspath(out)
    out_real = os.path.realpath(out_s)
    found: list[tuple[str, str]] = []  # (root, path)
    unreadable: list[Unreadable] = []
    earlier: list[str] = []
    checked: dict[str, bool] = {}
    for arg in inputs:
        if os.path.lexists(arg) and not os.path.isdir(arg):
            if inside(os.path.realpath(arg), out_real):
                raise _refuse_inside_out(arg, "this file", out_s)
            found.append((os.path.dirname(arg) or ".", arg))
        elif os.path.isdir(arg):
            if os.path.realpath(arg) == out_real:
                raise UsageError(
                    f"--out {out_s!r} is an input folder: outputs would be written next to the inputs; "
                    "choose another --out (a new folder, or one outside the inputs)"
                )
            if inside(os.path.realpath(arg), out_real):
                raise _refuse_inside_out(arg, "this folder", out_s)
            found.extend((arg, p) for p in walk(arg, out_real, unreadable, earlier))
        elif glob.has_magic(arg):
            base = glob_base(arg)
            if inside(os.path.realpath(base), out_real):
                raise _refuse_inside_out(arg, "this pattern", out_s)
            if "**" in pattern_parts(arg):  # walked, not glob.glob: a link loop made that list a file ~40 times
                recursive = recursive_glob(arg, out_real, unreadable, earlier)
                if not recursive:
                    raise UsageError(f"input {arg!r}: no file matches this pattern")
                found.extend((base, p) for p in recursive)
                continue
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise UsageError(f"input {arg!r}: no file matches this pattern")
            for m in matches:
                if inside(os.path.realpath(m), out_real):
                    continue
                if os.path.isdir(m):
                    found.extend((base, p) for p in walk(m, out_real, unreadable, earlier))
                elif is_image_name(m) and not below_earlier_output(m, base, earlier, checked):
                    found.append((base, m))
        else:
            raise UsageError(f"input {arg!r}: no such file or directory")
    items = _assign_keys(found)
    if not items:
        detail = ""
        if unreadable:
            detail = "; these folders could not be read: " + ", ".join(f"{u.path} ({u.error})" for u in unreadable[:5])
        if earlier:
            detail += ("; skipped the output folders of earlier runs (name one as an input to explain its files): "
                       + ", ".join(sorted(set(earlier))[:5]))
        raise UsageError(
            "no images found in the inputs (looked for " + ", ".join(sorted(IMAGE_EXTENSIONS)) + ")" + detail
        )
    return InputScan(items=items, unreadable=unreadable, earlier_outputs=sorted(set(earlier)))


def discover_inputs(inputs: Sequence[str], out: str | os.PathLike[str]) -> list[InputItem]:
    """The images of :func:`scan_inputs`, sorted by key (see there)."""
    return scan_inputs(inputs, out).items


@dataclass
class _Candidate:
    """One input file on its way to a key: ``parts`` below its root, plus what tells it apart."""

    root: str
    path: str
    parts: list[str]
    prefix: int = 0  # 1: the root folder's name before the parts; 2: that name + a hash of the root
    file_hash: bool = False  # a hash of the file's absolute path before its extension

    def key(self) -> str:
        parts = list(self.parts)
        if self.prefix:
            label = (_key_parts(os.path.basename(os.path.abspath(self.root))) or ["input"])[-1]
            if self.prefix >= 2:
                label += "~" + _hash(os.path.abspath(self.root))
            parts.insert(0, label)
        if self.file_hash:
            stem, ext = os.path.splitext(parts[-1])
            parts[-1] = f"{stem}~{_hash(os.path.abspath(self.path))}{ext}"
        return "/".join(parts)


def _assign_keys(found: list[tuple[str, str]]) -> list[InputItem]:
    """Unique, stable keys for ``(root, path)`` pairs (see the module docstring)."""
    by_file: dict[str, _Candidate] = {}
    for root, path in found:
        parts = _key_parts(os.path.relpath(path, root)) or _key_parts(os.path.basename(path)) or ["image"]
        cand = _Candidate(root, path, parts)
        norm = os.path.normcase(os.path.abspath(path))
        old = by_file.get(norm)
        if old is None or (len(cand.parts), cand.key()) < (len(old.parts), old.key()):
            by_file[norm] = cand  # the same file twice: its shortest key, whatever the order
    cands = list(by_file.values())
    for _ in range(8):  # each pass tells colliding keys apart further; file hashes end it
        groups: dict[str, list[_Candidate]] = {}
        for c in cands:
            groups.setdefault(c.key().casefold(), []).append(c)
        clashes = [g for g in groups.values() if len(g) > 1]
        if not clashes:
            break
        for group in clashes:
            roots = [os.path.abspath(c.root) for c in group]
            for c, root in zip(group, roots):
                if roots.count(root) > 1 or c.prefix == 2:  # the same root: only the file tells them apart
                    c.file_hash = True
                else:
                    c.prefix += 1
    keys = _rename_clashing_folders([c.key() for c in cands])
    items = [InputItem(path=c.path, key=k) for c, k in zip(cands, keys)]
    items.sort(key=lambda it: it.key)
    return items


def _rename_clashing_folders(keys: list[str]) -> list[str]:
    """Give ``~hash`` to folder components named like an output file of a sibling key
    (``K.<word>.<ext>``), or like a file at the top of ``--out``."""
    names_in: dict[str, set[str]] = {}
    for key in keys:
        parent, _, name = key.rpartition("/")
        names_in.setdefault(parent.casefold(), set()).add(name.casefold())

    def clashes(parent: str, folder: str) -> bool:
        if not parent and folder.casefold() in RESERVED_TOP:
            return True
        head, _, ext = folder.casefold().rpartition(".")
        head, _, word = head.rpartition(".")
        return bool(head and word) and ext in OUTPUT_EXTENSIONS and head in names_in.get(parent.casefold(), ())

    renamed: dict[str, str] = {}
    out = []
    for key in keys:
        original = key.split("/")
        parts = list(original)
        for i in range(len(original) - 1):
            prefix = "/".join(original[: i + 1])
            if prefix not in renamed:
                clash = clashes("/".join(original[:i]), original[i])
                renamed[prefix] = original[i] + "~" + _hash(prefix) if clash else original[i]
            parts[i] = renamed[prefix]
        out.append("/".join(parts))
    return out
