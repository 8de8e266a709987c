"""An explanation's folder: ``maps.npy`` and ``manifest.json``, written by ``Explanation.save`` and read back by
``Explanation.load`` (and the caption explanations' own), and ``extras.npz`` when the explanation has extras.

The manifest holds what the maps need to be placed on their images again: the token layout (prefix tokens,
grid, patch size: which pixels the cells cover), the input size, the crop boxes in the original images, the
targets and their label names, the method's options (JSON values: lists and dicts as such, tuples as lists),
and the structure of ``e.extras`` (its arrays stored in ``extras.npz``, named in the manifest). The images
themselves are not written (``overlay(i, image=...)`` takes the original image, or the region the model saw,
again).
"""

from __future__ import annotations

import io
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
           "boxes_json", "boxes_from_json", "extras_json", "extras_from_json", "EXTRAS_FILE"]

#: The file of an explanation's folder that holds the arrays of ``e.extras``.
EXTRAS_FILE = "extras.npz"

# How the manifest names an array of extras.npz in place of the value.
_ARRAY_KEY = "__array__"


def _json_value(value: Any, arrays: Optional[dict[str, np.ndarray]] = None) -> Any:
    """``value`` as JSON: numbers, text, None; lists, tuples (as lists) and dicts with text keys item by item;
    NumPy scalars as their Python number; tensors and arrays as ``{"__array__": name}`` with the array put in
    ``arrays`` (when given; else their repr, as any other value)."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, np.generic) and isinstance(value.item(), (bool, int, float, str)):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_json_value(v, arrays) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value) and _ARRAY_KEY not in value:
        return {k: _json_value(v, arrays) for k, v in value.items()}
    if arrays is not None and isinstance(value, (Tensor, np.ndarray)):
        name = f"a{len(arrays)}"
        arrays[name] = value.detach().cpu().numpy() if isinstance(value, Tensor) else np.asarray(value)
        return {_ARRAY_KEY: name}
    return repr(value)


def json_options(options: dict[str, Any]) -> dict[str, Any]:
    """Method options as JSON values: lists, tuples (as lists) and dicts of them kept (``layers=[1, 2]`` was written
    as the text ``"[1, 2]"``, which the method then refused when the loaded options were passed again); other
    values as their repr."""
    return {k: _json_value(v) for k, v in options.items()}


def extras_json(extras: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """An explanation's ``extras`` as JSON, with its tensors and arrays set apart.

    Returns:
        (the JSON value, each tensor or array in it replaced by ``{"__array__": name}``; name -> NumPy array).
    """
    arrays: dict[str, np.ndarray] = {}
    return {str(k): _json_value(v, arrays) for k, v in extras.items()}, arrays


def extras_from_json(value: Any, arrays: Any) -> Any:
    """The extras :func:`extras_json` wrote, their arrays as CPU tensors from ``arrays`` (name -> array)."""
    if isinstance(value, dict):
        if set(value) == {_ARRAY_KEY}:
            return torch.from_numpy(np.array(arrays[value[_ARRAY_KEY]]))
        return {k: extras_from_json(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [extras_from_json(v, arrays) for v in value]
    return value


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


def write_saved(directory: Any, maps: Tensor, manifest: dict[str, Any],
                arrays: Optional[dict[str, np.ndarray]] = None) -> Path:
    """``maps.npy`` and ``manifest.json`` written (atomically) into the folder ``directory``, created if missing;
    ``extras.npz`` too when ``arrays`` (name -> array, :func:`extras_json`) holds any. The manifest is written
    last, so a folder whose manifest is in place holds the files it names.

    Raises:
        UsageError: ``directory`` is not a path, is a file, or lies below a file (a bare ``OSError`` before).
    """
    from .files import check_file_path, encode_npy, write_user_file

    out = _folder(directory, "save")
    if out.exists() and not out.is_dir():
        raise UsageError(f"cannot save into {str(out)!r}: it is a file; pass a folder (it is created if missing)")
    check_file_path(out / "maps.npy", "explanation")
    _check_not_foreign(out)
    write_user_file(out / "maps.npy", encode_npy(maps.detach().cpu().numpy()), "explanation")
    if arrays:
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        write_user_file(out / EXTRAS_FILE, buffer.getvalue(), "explanation")
    elif (out / EXTRAS_FILE).is_file():  # an earlier explanation's (checked above), which this manifest does not name
        (out / EXTRAS_FILE).unlink()
    write_user_file(out / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode("utf-8"), "explanation")
    return out


def _check_not_foreign(out: Path) -> None:
    """Raise when the folder holds a ``manifest.json``, ``maps.npy`` or ``extras.npz`` that no earlier save wrote (a
    data set's manifest, the user's own arrays): saving there would replace them."""
    names = [n for n in ("manifest.json", "maps.npy", EXTRAS_FILE) if (out / n).exists()]
    if not names:
        return
    try:
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
        ours = isinstance(manifest, dict) and {"method", "input_size", "grid"} <= set(manifest)
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise UsageError(f"cannot save into {str(out)!r}: it holds {', '.join(names)} that no explanation's save wrote "
                         "(saving would replace them); choose an empty or new folder")


def read_saved(directory: Any, dims: int) -> tuple[Tensor, dict[str, Any]]:
    """The maps and manifest of a folder an explanation was saved to.

    Args:
        directory: the folder ``save`` wrote.
        dims: the maps' number of dimensions (3: ``(B, h, w)``; 4: ``(B, T, h, w)``).

    Returns:
        (maps float32 CPU tensor, the manifest); the manifest's ``"extras"`` (when the explanation had any) holds
        them as :func:`extras_from_json` returns them, their arrays read from ``extras.npz``.

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
    if manifest.get("extras"):
        manifest["extras"] = _read_extras(folder, manifest["extras"])
    return torch.from_numpy(np.ascontiguousarray(maps, dtype=np.float32)), manifest


def _names_arrays(value: Any) -> bool:
    """Whether a JSON value of :func:`extras_json` names an array of ``extras.npz``."""
    if isinstance(value, dict):
        return set(value) == {_ARRAY_KEY} or any(_names_arrays(v) for v in value.values())
    return isinstance(value, list) and any(_names_arrays(v) for v in value)


def _read_extras(folder: Path, value: Any) -> Any:
    """The extras of a manifest with their arrays from ``extras.npz`` (read only when the manifest names any)."""
    if not _names_arrays(value):
        return extras_from_json(value, {})
    path = folder / EXTRAS_FILE
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
        return extras_from_json(value, arrays)
    except (OSError, ValueError, KeyError) as err:  # missing, damaged, or without an array the manifest names
        raise UsageError(f"cannot load the extras of the explanation in {str(folder)!r} from {EXTRAS_FILE}: {err}; "
                         "save the explanation again") from None


def _folder(directory: Any, what: str) -> Path:
    """``directory`` as a Path, or a UsageError saying what to pass."""
    if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise UsageError(f"{what} needs a folder path (str or pathlib.Path"
                         f"{'; created if missing' if what == 'save' else ''}), got {directory!r}")
    return Path(directory)
