"""An explanation's folder: ``maps.npy`` and ``manifest.json``, written by ``Explanation.save`` and read back by
``Explanation.load`` (and the caption explanations' own).

The manifest holds what the maps need to be placed on their images again: the token layout (prefix tokens,
grid, patch size: which pixels the cells cover), the input size, the crop boxes in the original images, the
targets and their label names. The images themselves are not written (``overlay(i, image=...)`` takes the
original image, or the region the model saw, again).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from .errors import UsageError
from .layout import TokenLayout

__all__ = ["write_saved", "read_saved", "json_options", "json_sources", "layout_json", "layout_from_json",
           "boxes_json", "boxes_from_json"]


def json_options(options: dict[str, Any]) -> dict[str, Any]:
    """Method options as JSON values (others as their repr)."""
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v) for k, v in options.items()}


def json_sources(sources: Optional[list[Any]]) -> Optional[list[Optional[str]]]:
    """The sources as given (paths as text), or None."""
    return [str(s) if s is not None else None for s in sources] if sources else None


def layout_json(layout: Optional[TokenLayout]) -> Optional[dict[str, Any]]:
    """A token layout as a JSON object (None stays None)."""
    return None if layout is None else asdict(layout)


def layout_from_json(value: Any) -> Optional[TokenLayout]:
    """The :class:`TokenLayout` :func:`layout_json` wrote (its grid and patch size as tuples)."""
    if value is None:
        return None
    fields = dict(value)
    for key in ("grid", "patch_size"):
        if fields.get(key) is not None:
            fields[key] = tuple(int(v) for v in fields[key])
    return TokenLayout(**fields)


def boxes_json(boxes: Optional[list[Any]]) -> Optional[list[Optional[dict[str, Any]]]]:
    """Crop boxes (:class:`~vitexplain.data.images.CropBox`) as JSON objects, or None."""
    return None if boxes is None else [None if b is None else asdict(b) for b in boxes]


def boxes_from_json(value: Any) -> Optional[list[Any]]:
    """The crop boxes :func:`boxes_json` wrote."""
    if value is None:
        return None
    from .data.images import CropBox

    return [None if b is None else CropBox(**{**b, "image_size": tuple(b["image_size"])}) for b in value]


def write_saved(directory: Any, maps: Tensor, manifest: dict[str, Any]) -> Path:
    """``maps.npy`` and ``manifest.json`` written (atomically) into the folder ``directory``, created if missing.

    Raises:
        UsageError: ``directory`` is not a path, is a file, or lies below a file (a bare ``OSError`` before).
    """
    from .files import check_file_path, encode_npy, write_user_file

    out = _folder(directory, "save")
    if out.exists() and not out.is_dir():
        raise UsageError(f"cannot save into {str(out)!r}: it is a file; pass a folder (it is created if missing)")
    check_file_path(out / "maps.npy", "explanation")
    write_user_file(out / "maps.npy", encode_npy(maps.detach().cpu().numpy()), "explanation")
    write_user_file(out / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode("utf-8"), "explanation")
    return out


def read_saved(directory: Any, dims: int) -> tuple[Tensor, dict[str, Any]]:
    """The maps and manifest of a folder an explanation was saved to.

    Args:
        directory: the folder ``save`` wrote.
        dims: the maps' number of dimensions (3: ``(B, h, w)``; 4: ``(B, T, h, w)``).

    Returns:
        (maps float32 CPU tensor, the manifest).

    Raises:
        UsageError: not a folder an explanation was saved to, or its files disagree.
    """
    folder = _folder(directory, "load")
    maps_path, manifest_path = folder / "maps.npy", folder / "manifest.json"
    missing = [p.name for p in (maps_path, manifest_path) if not p.is_file()]
    if missing:
        raise UsageError(f"cannot load an explanation from {str(folder)!r}: no {' or '.join(missing)} there; pass the "
                         "folder Explanation.save(folder) wrote")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        maps = np.load(maps_path, allow_pickle=False)
    except (OSError, ValueError) as err:  # (json.JSONDecodeError and a damaged .npy are ValueErrors)
        raise UsageError(f"cannot load an explanation from {str(folder)!r}: {err}") from None
    if not isinstance(manifest, dict) or "method" not in manifest:
        raise UsageError(f"{str(manifest_path)!r} is not an explanation's manifest (it has no method)")
    if ("captions" in manifest) != (dims == 4):
        kind, other = ("a caption", "CaptionExplanation") if "captions" in manifest else ("an image", "Explanation")
        raise UsageError(f"{str(folder)!r} holds {kind} explanation: read it with {other}.load")
    if maps.ndim != dims or maps.dtype.kind != "f":
        raise UsageError(f"{str(maps_path)!r} holds a {maps.dtype} array of shape {maps.shape}, not the {dims}-D "
                         "float maps an explanation saves")
    return torch.from_numpy(np.ascontiguousarray(maps, dtype=np.float32)), manifest


def _folder(directory: Any, what: str) -> Path:
    """``directory`` as a Path, or a UsageError saying what to pass."""
    if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise UsageError(f"{what} needs a folder path (str or pathlib.Path"
                         f"{'; created if missing' if what == 'save' else ''}), got {directory!r}")
    return Path(directory)
