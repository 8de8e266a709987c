"""The batch export engine behind ``vitexplain export`` (also usable from Python).

::

    from vitexplain.export import ExportOptions, export
    result = export(ExportOptions(inputs=["photos/"], out="maps/", methods=["rollout", "cdam"]))
    result.exit_code, result.summary["counts"]

Pipeline: inputs are discovered (files, folders walked recursively, globs) and sorted by their
output key; a :class:`torch.utils.data.DataLoader` decodes and preprocesses them (in worker
processes with ``workers > 0``; a file that cannot be read becomes an error record, it never
kills a worker); the model explains each batch with every method in one shared forward /
backward (:meth:`vitexplain.Explainer.explain`); a small thread pool draws the overlays,
encodes the PNGs and writes them atomically while the next batch runs.

Output layout (``OUT`` = ``--out``)::

    OUT/<key>.<method>.png     overlay on the region the model saw, per image and method
    OUT/<key>.<method>.npy     raw (gh, gw) float32 map (with save_maps)
    OUT/manifest.jsonl         one JSON line per image (see :func:`export`)
    OUT/summary.json           counts, timings, versions, arguments
    OUT/index.html             gallery (with html)

``<key>`` is the input's path relative to the input argument it was found under (a file given
directly: its name; a folder: the path below it; a glob: the path below the glob's fixed
prefix), with ``.``/``..``/empty components dropped, so outputs never leave ``OUT``. The file
name keeps its extension (``a.jpg`` and ``a.png`` stay apart). Keys that would collide (two
folders with the same layout) are prefixed with the input folder's name, then numbered.

Every file is written to a hidden temporary name in its destination folder and moved into
place with :func:`os.replace`, so an interrupted run leaves no half-written file; manifest
records are appended (and flushed) line by line to ``manifest.rank{r}.jsonl`` while the run
goes and merged into ``manifest.jsonl`` at the end.

The driver (:func:`_drive`: sharding, resume, decoding, the writer pool, the manifest and the
summary counts) is shared with ``vitexplain caption`` (:mod:`vitexplain.caption_export`): a
command supplies how a batch is explained (:data:`ProcessFn`) and how one image's files are
written (:data:`WriteFn`).

Distributed: when ``WORLD_SIZE > 1`` (torchrun, SLURM wrappers...), rank ``r`` takes items
``r, r + W, r + 2W, ...`` of the sorted list, uses ``cuda:{LOCAL_RANK}`` on GPU, and after a
barrier (``gloo`` on CPU, ``nccl`` on CUDA) rank 0 merges the manifest parts and writes
``summary.json`` and ``index.html``.
"""

from __future__ import annotations

import glob
import functools
import hashlib
import io
import json
import os
import re
import sys
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

from .errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch
    from torch import nn

__all__ = [
    "ExportOptions",
    "ExportResult",
    "InputItem",
    "UsageError",
    "IMAGE_EXTENSIONS",
    "DEFAULT_METHODS",
    "discover_inputs",
    "load_model",
    "export",
    "read_manifest",
]

#: File extensions (lower case) picked up when walking folders or expanding globs. A file
#: named explicitly on the command line is tried whatever its extension.
IMAGE_EXTENSIONS: frozenset[str] = frozenset(
    {".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".bmp", ".gif", ".tif", ".tiff", ".webp",
     ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".ico"}
)

#: Methods exported when ``--method`` is not given, per model family.
DEFAULT_METHODS: dict[str, tuple[str, ...]] = {"vit": ("rollout", "cdam"), "swin": ("rollout", "cdam"), "cnn": ("gradcam",)}

MANIFEST = "manifest.jsonl"
SUMMARY = "summary.json"
GALLERY = "index.html"
_PART = "manifest.rank{rank}.jsonl"
_PART_RE = re.compile(r"^manifest\.rank\d+\.jsonl$")


# UsageError lives in vitexplain.errors (a VitexplainError); re-exported here for old imports.


# ---------------------------------------------------------------------------------------------
# options and results
# ---------------------------------------------------------------------------------------------
@dataclass
class ExportOptions:
    """Everything ``vitexplain export`` can be asked to do (the CLI flags, one to one).

    Attributes:
        inputs: files, folders (walked recursively) and glob patterns.
        out: output folder (created).
        model: a zoo name (``vx.zoo.names()``), a timm model name (random weights unless
            ``checkpoint``), or the path of a zoo-format checkpoint ``.json``.
        checkpoint: weights for ``model``: ``.safetensors``, or ``.pt``/``.pth``/``.bin`` read
            with ``torch.load(weights_only=True)``; a state dict or ``{"state_dict"|"model": ...}``.
        num_classes: classifier size for timm models (default: from the checkpoint, else timm's).
        model_args: extra ``timm.create_model`` keyword arguments (e.g. ``img_size=64``).
        labels: text file with one class name per line (for timm models without names).
        methods: method names; None uses :data:`DEFAULT_METHODS` of the model's family.
        method_options: per method, keyword options (e.g. ``{"rollout": {"discard_ratio": 0.9}}``).
        target: ``"pred"`` (each image's top prediction), a class index, or a label name.
        batch_size: images per forward pass.
        workers: DataLoader worker processes decoding and preprocessing (0: in the main process).
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        amp: ``None``, ``"bf16"`` or ``"fp16"`` (CUDA autocast).
        crop: resize + center-crop like the model's eval transform (False: resize only).
        alpha: overlay opacity.
        colormap: colormap of unsigned maps.
        signed_colormap: colormap of signed maps (diverging, centred at zero).
        max_side: overlays larger than this (longer side, pixels) are drawn downscaled; 0 = never.
        topk: predictions recorded per image.
        save_maps: also write each raw map as ``.npy``.
        html: write ``index.html``.
        overwrite: redo images whose outputs are already complete and current.
        quiet: no progress bar and no final summary line (errors are still printed).
        write_threads: threads drawing overlays and writing files while the model runs.
    """

    inputs: list[str]
    out: str
    model: str = "shapes-vit"
    checkpoint: Optional[str] = None
    num_classes: Optional[int] = None
    model_args: dict[str, Any] = field(default_factory=dict)
    labels: Optional[str] = None
    methods: Optional[list[str]] = None
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    target: str = "pred"
    batch_size: int = 32
    workers: int = 0
    device: str = "auto"
    amp: Optional[str] = None
    crop: bool = True
    alpha: float = 0.5
    colormap: str = "jet"
    signed_colormap: str = "bwr"
    max_side: int = 512
    topk: int = 5
    save_maps: bool = False
    html: bool = False
    overwrite: bool = False
    quiet: bool = False
    write_threads: int = field(default_factory=lambda: max(2, min(8, (os.cpu_count() or 2) // 2)))


@dataclass
class ExportResult:
    """What :func:`export` returns.

    Attributes:
        exit_code: 0 all good, 1 some images failed (the CLI's exit status).
        summary: the content of ``summary.json`` (on rank 0; other ranks get their own counts).
        out: the output folder.
    """

    exit_code: int
    summary: dict[str, Any]
    out: Path


@dataclass(frozen=True)
class InputItem:
    """One image to export.

    Attributes:
        path: the file as found (as given, or joined below the folder given).
        key: its output key: posix path relative to ``--out``, without method suffix.
    """

    path: str
    key: str


# ---------------------------------------------------------------------------------------------
# input discovery
# ---------------------------------------------------------------------------------------------
def _is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _inside(path: str, folder: str) -> bool:
    """Whether real path ``path`` is ``folder`` or below it (both already realpath'd)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _safe_parts(rel: str) -> list[str]:
    parts = re.split(r"[\\/]" if os.altsep else "/", rel.replace(os.sep, "/"))
    return [p for p in parts if p not in ("", ".", "..")]


def _glob_base(pattern: str) -> str:
    """The fixed folder prefix of a glob pattern (``a/b/*/c*.png`` -> ``a/b``)."""
    drive, rest = os.path.splitdrive(pattern)
    parts = rest.split(os.sep) if not os.altsep else re.split(r"[\\/]", rest)
    fixed: list[str] = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    if not fixed:
        return drive or "."
    base = os.sep.join(fixed)
    return drive + (base or os.sep)


def _walk(folder: str, out_real: str) -> Iterable[str]:
    """Image files below ``folder``, sorted, skipping hidden entries and the output folder.

    Symlinked folders are followed once (loops are cut by device/inode).
    """
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        try:
            st = os.stat(dirpath)
            ident = (st.st_dev, st.st_ino)
        except OSError:
            dirnames[:] = []
            continue
        if ident in seen:
            dirnames[:] = []
            continue
        seen.add(ident)
        keep = []
        for d in sorted(dirnames):
            if d.startswith("."):
                continue
            if os.path.realpath(os.path.join(dirpath, d)) == out_real:
                continue  # never read our own outputs back
            keep.append(d)
        dirnames[:] = keep
        for name in sorted(filenames):
            if not name.startswith(".") and _is_image_name(name):
                yield os.path.join(dirpath, name)


def discover_inputs(inputs: Sequence[str], out: str | os.PathLike[str]) -> list[InputItem]:
    """Expand input arguments into image items with unique output keys, sorted by key.

    Args:
        inputs: files (any extension), folders (walked recursively for image extensions,
            hidden entries skipped) and glob patterns (``**`` recursive). A path that exists
            is taken literally even if it contains glob characters.
        out: the output folder: it is skipped while walking and matching, and it may not be
            an input folder itself (outputs would land next to the inputs).

    Returns:
        Items sorted by key; the same file reached twice is listed once.

    Raises:
        UsageError: an argument matches nothing, no image is found, or ``out`` is an input folder.
    """
    out_real = os.path.realpath(os.fspath(out))
    found: list[tuple[str, str, int]] = []  # (root, path, argument index)
    roots: set[str] = set()
    for k, arg in enumerate(inputs):
        if os.path.isdir(arg):
            roots.add(os.path.realpath(arg))
            found.extend((arg, p, k) for p in _walk(arg, out_real))
        elif os.path.lexists(arg):
            root = os.path.dirname(arg) or "."
            roots.add(os.path.realpath(root))
            found.append((root, arg, k))
        elif glob.has_magic(arg):
            base = _glob_base(arg)
            base_in_out = _inside(os.path.realpath(base), out_real)
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise UsageError(f"input {arg!r}: no file matches this pattern")
            for m in matches:
                if not base_in_out and _inside(os.path.realpath(m), out_real):
                    continue
                if os.path.isdir(m):
                    roots.add(os.path.realpath(m))
                    found.extend((base, p, k) for p in _walk(m, out_real))
                elif _is_image_name(m):
                    roots.add(os.path.realpath(os.path.dirname(m) or "."))
                    found.append((base, m, k))
        else:
            raise UsageError(f"input {arg!r}: no such file or directory")
    if out_real in roots:
        raise UsageError(
            f"--out {os.fspath(out)!r} is an input folder: outputs would be written next to the "
            "inputs; choose another --out (a new folder, or one outside the inputs)"
        )

    items: list[InputItem] = []
    taken: set[str] = set()  # casefolded keys (case-insensitive file systems)
    seen_paths: set[str] = set()
    for root, path, k in found:
        norm = os.path.normcase(os.path.abspath(path))
        if norm in seen_paths:
            continue
        seen_paths.add(norm)
        parts = _safe_parts(os.path.relpath(path, root)) or _safe_parts(os.path.basename(path)) or ["image"]
        key = "/".join(parts)
        if key.casefold() in taken:
            label = _safe_parts(os.path.basename(os.path.abspath(root)))
            key = "/".join([*(label or [f"input{k}"]), *parts])
        if key.casefold() in taken:
            stem = key
            n = 2
            while f"{stem}~{n}".casefold() in taken:
                n += 1
            key = f"{stem}~{n}"
        taken.add(key.casefold())
        items.append(InputItem(path=path, key=key))
    if not items:
        raise UsageError(
            "no images found in the inputs (looked for " + ", ".join(sorted(IMAGE_EXTENSIONS)) + ")"
        )
    items.sort(key=lambda it: it.key)
    return items


# ---------------------------------------------------------------------------------------------
# model loading
# ---------------------------------------------------------------------------------------------
def _read_state_dict(path: str) -> dict[str, Any]:
    import torch

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--checkpoint {path!r}: no such file")
    try:
        if p.suffix.lower() == ".safetensors":
            from safetensors.torch import load_file

            obj: Any = load_file(str(p), device="cpu")
        else:
            obj = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(
            f"--checkpoint {path!r}: cannot read it ({type(e).__name__}: {e}). Pass a .safetensors "
            "file or a .pt/.pth holding tensors only (a state dict, or {'state_dict': ...})"
        ) from None
    if isinstance(obj, dict):
        for name in ("state_dict", "model", "model_state_dict", "module", "ema"):
            if isinstance(obj.get(name), dict):
                obj = obj[name]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UsageError(
            f"--checkpoint {path!r}: expected a state dict (parameter name -> tensor), or a dict "
            "with one under 'state_dict' or 'model'"
        )
    for prefix in ("module.", "_orig_mod."):  # DDP / torch.compile wrappers
        if all(k.startswith(prefix) for k in obj):
            obj = {k[len(prefix):]: v for k, v in obj.items()}
    return obj


def _head_size(state: dict[str, Any]) -> Optional[int]:
    for key in ("head.weight", "head.fc.weight", "fc.weight", "classifier.weight", "head.l.weight"):
        w = state.get(key)
        if w is not None and getattr(w, "dim", lambda: 0)() == 2:
            return int(w.shape[0])
    return None


def load_model(
    spec: str,
    *,
    checkpoint: Optional[str] = None,
    num_classes: Optional[int] = None,
    model_args: Optional[dict[str, Any]] = None,
    labels: Optional[str] = None,
    device: Any = "cpu",
) -> tuple["nn.Module", dict[str, Any]]:
    """Build the model to export with, in eval mode, offline.

    Args:
        spec: a zoo name, a zoo-format checkpoint ``.json`` path, or a timm model name
            (created with ``pretrained=False``; weights from ``checkpoint``).
        checkpoint: state dict file (see :class:`ExportOptions`).
        num_classes: classifier size of a timm model (default: the checkpoint's head size).
        model_args: extra ``timm.create_model`` arguments.
        labels: a text file with one class name per line.
        device: where to put the model.

    Returns:
        ``(model, info)`` with ``info`` = ``{"name", "source": "zoo"|"file"|"timm", "checkpoint",
        "random_weights"}``.

    Raises:
        UsageError: unknown model name, unreadable or mismatching checkpoint, missing zoo weights.
    """
    from . import zoo

    info: dict[str, Any] = {"name": spec, "checkpoint": checkpoint, "random_weights": False}
    model_args = dict(model_args or {})
    if spec in zoo.names() or spec.endswith(".json"):
        if model_args or num_classes is not None:
            raise UsageError("--num-classes and --model-arg apply to timm models, not to zoo checkpoints")
        try:
            if spec in zoo.names():
                model, info["source"] = zoo.load(spec), "zoo"
            else:
                model, info["source"] = zoo.load_checkpoint(spec), "file"
        except (FileNotFoundError, OSError, ValueError, KeyError) as e:
            raise UsageError(f"--model {spec!r}: cannot load it: {e}") from None
        if checkpoint:
            _load_state(model, _read_state_dict(checkpoint), checkpoint)
    else:
        import timm

        if not timm.is_model(spec):
            import difflib

            close = difflib.get_close_matches(spec, [*zoo.names(), *timm.list_models()], n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise UsageError(
                f"unknown model {spec!r}: not a zoo model ({', '.join(zoo.names())}), not a "
                f"zoo checkpoint .json and not a timm model name.{hint} See `vitexplain models`."
            )
        state = _read_state_dict(checkpoint) if checkpoint else None
        if num_classes is None and state is not None:
            num_classes = _head_size(state)
        if num_classes is not None:
            model_args["num_classes"] = int(num_classes)
        try:
            model = timm.create_model(spec, pretrained=False, **model_args)
        except Exception as e:
            raise UsageError(f"cannot create timm model {spec!r} with {model_args}: {e}") from None
        info["source"] = "timm"
        _fix_input_size(model)
        if state is not None:
            _load_state(model, state, checkpoint)
        else:
            info["random_weights"] = True
    if labels:
        try:
            names = [line.strip() for line in Path(labels).read_text(encoding="utf-8").splitlines() if line.strip()]
        except OSError as e:
            raise UsageError(f"--labels {labels!r}: cannot read it ({e.strerror or e})") from None
        cfg = dict(getattr(model, "pretrained_cfg", None) or {})
        cfg["label_names"] = names
        model.pretrained_cfg = cfg
    return model.eval().to(device), info


def _fix_input_size(model: "nn.Module") -> None:
    """Make ``pretrained_cfg["input_size"]`` agree with a ViT built for another ``img_size``.

    ``timm.create_model("vit_..._224", img_size=64)`` keeps the 224 px ``pretrained_cfg``, so
    preprocessing (which reads it) would feed 224 px images to a 64 px model.
    """
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    cfg = getattr(model, "pretrained_cfg", None)
    if size is None or not isinstance(cfg, dict) or getattr(model.patch_embed, "dynamic_img_size", False):
        return
    size = (int(size), int(size)) if isinstance(size, int) else tuple(int(v) for v in size)
    if len(size) == 2 and tuple(cfg.get("input_size", (3, *size))[-2:]) != size:
        model.pretrained_cfg = {**cfg, "input_size": (3, *size)}


def _load_state(model: "nn.Module", state: dict[str, Any], path: Optional[str]) -> None:
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        msg = str(e).strip().splitlines()
        detail = " ".join(m.strip() for m in msg[:4])
        raise UsageError(
            f"--checkpoint {path!r} does not fit the model: {detail}. Check --model, --num-classes "
            "and --model-arg (e.g. img_size=..., patch_size=...)"
        ) from None


# ---------------------------------------------------------------------------------------------
# data loading (runs in DataLoader workers)
# ---------------------------------------------------------------------------------------------
class _ImageDataset:
    """Decode + preprocess one image; errors become records instead of exceptions.

    Items are dicts: ``{"i", "x" (3, H, W), "region" (h, w, 3) uint8, "width", "height",
    "box"}`` or ``{"i", "error"}``.
    """

    def __init__(self, paths: Sequence[str], preprocess_kwargs: dict[str, Any], crop: bool, max_side: int) -> None:
        self.paths = list(paths)
        self.kwargs = dict(preprocess_kwargs)
        self.crop = crop
        self.max_side = int(max_side)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        from .data.images import crop_region, load_image, preprocess

        path = self.paths[i]
        try:
            image = load_image(path)
            x, boxes = preprocess([image], crop=self.crop, **self.kwargs)
            region = crop_region(image, boxes[0]) if self.crop else image
            region = _cap_size(region, self.max_side)
            h, w = image.shape[:2]
            return {"i": i, "x": x[0], "region": region, "width": int(w), "height": int(h),
                    "box": list(boxes[0].to_int())}
        except Exception as e:  # a bad file is a record, never a dead worker
            return {"i": i, "error": str(e) or type(e).__name__}


def _cap_size(image: "np.ndarray", max_side: int) -> "np.ndarray":
    h, w = image.shape[:2]
    if max_side <= 0 or max(h, w) <= max_side or min(h, w) == 0:
        return image
    import cv2

    s = max_side / max(h, w)
    size = (max(1, round(w * s)), max(1, round(h * s)))
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA)


def _collate(samples: list[dict[str, Any]]) -> tuple[Optional["torch.Tensor"], list[dict[str, Any]], list[dict[str, Any]]]:
    import torch

    good = [s for s in samples if "error" not in s]
    bad = [s for s in samples if "error" in s]
    x = torch.stack([s.pop("x") for s in good]) if good else None
    return x, good, bad


# ---------------------------------------------------------------------------------------------
# file writing (runs in writer threads)
# ---------------------------------------------------------------------------------------------
class _Writer:
    """Atomic file writes with a cache of created folders (thread-safe enough: makedirs is idempotent)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._dirs: set[str] = set()

    def write(self, rel: str, data: bytes) -> None:
        dest = os.path.join(self.out, *rel.split("/"))
        folder = os.path.dirname(dest)
        if folder not in self._dirs:
            os.makedirs(folder, exist_ok=True)
            self._dirs.add(folder)
        tmp = os.path.join(folder, f".{uuid.uuid4().hex[:12]}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, dest)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def _encode_png(rgb: "np.ndarray") -> bytes:
    import cv2
    import numpy as np

    ok, buf = cv2.imencode(".png", np.ascontiguousarray(rgb[..., ::-1]), [cv2.IMWRITE_PNG_COMPRESSION, 1])
    if not ok:  # pragma: no cover - OpenCV failure
        raise OSError("OpenCV could not encode the PNG")
    return buf.tobytes()


def _encode_npy(array: "np.ndarray") -> bytes:
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)
    return buf.getvalue()


#: ``write(writer, files)``: writes one image's output files, adding each finished one to
#: ``files`` (``{group: {kind: path relative to OUT}}``, e.g. ``{"cdam": {"overlay": ...}}``).
WriteFn = Callable[["_Writer", dict[str, dict[str, str]]], None]


def _write_outputs(rec: dict[str, Any], write: WriteFn, writer: _Writer) -> tuple[dict[str, Any], float]:
    """Run one image's write job (in a writer thread); returns (record, seconds).

    The record becomes ``ok`` with its ``files``, or ``failed`` with an error and the files
    finished before it.
    """
    t = time.perf_counter()
    files: dict[str, dict[str, str]] = {}
    try:
        write(writer, files)
        rec["status"] = "ok"
    except Exception as e:
        rec["status"] = "failed"
        rec["error"] = f"writing the outputs of {rec['input']} failed: {type(e).__name__}: {e}"
    rec["files"] = files
    rec["time"] = time.time()
    return rec, time.perf_counter() - t


def _write_overlays(
    writer: _Writer,
    files: dict[str, dict[str, str]],
    *,
    key: str,
    region: "np.ndarray",
    maps: dict[str, "np.ndarray"],
    opts: ExportOptions,
    signed: dict[str, bool],
) -> None:
    """``export``'s write job: per method, the overlay PNG (and the raw map with save_maps)."""
    from .viz.overlays import overlay

    for name, m in maps.items():
        normalize = "signed" if signed[name] else "minmax"
        cmap = opts.signed_colormap if signed[name] else opts.colormap
        rgb = overlay(region, m, alpha=opts.alpha, colormap=cmap, normalize=normalize)
        entry = {"overlay": f"{key}.{name}.png"}
        writer.write(entry["overlay"], _encode_png(rgb))
        if opts.save_maps:
            entry["map"] = f"{key}.{name}.npy"
            writer.write(entry["map"], _encode_npy(m))
        files[name] = entry


# ---------------------------------------------------------------------------------------------
# manifest
# ---------------------------------------------------------------------------------------------
def _json_line(record: dict[str, Any]) -> bytes:
    line = json.dumps(record, ensure_ascii=False)
    try:
        return (line + "\n").encode("utf-8")
    except UnicodeEncodeError:  # undecodable file names (surrogate escapes): escape them
        return (json.dumps(record, ensure_ascii=True) + "\n").encode("ascii")


def _read_jsonl(path: Path) -> Iterable[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue  # a line cut short by an interruption
                if isinstance(rec, dict) and isinstance(rec.get("key"), str):
                    yield rec
    except FileNotFoundError:
        return


def read_manifest(out: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Latest record per key from ``manifest.jsonl`` and any unmerged ``manifest.rank*.jsonl``.

    Parts are left by interrupted runs (or are being written by a running one); a record with
    a later ``time`` wins.

    Returns:
        ``{key: record}``.
    """
    folder = Path(out)
    paths = [folder / MANIFEST]
    if folder.is_dir():
        paths += sorted(p for p in folder.iterdir() if _PART_RE.match(p.name))
    latest: dict[str, dict[str, Any]] = {}
    for path in paths:
        for rec in _read_jsonl(path):
            old = latest.get(rec["key"])
            if old is None or float(rec.get("time", 0)) >= float(old.get("time", 0)):
                latest[rec["key"]] = rec
    return latest


def _atomic_text(path: Path, text: str) -> None:
    _Writer(path.parent).write(path.name, text.encode("utf-8", "surrogateescape"))


def _is_current(rec: Optional[dict[str, Any]], source: dict[str, Any], config_hash: str, out: Path) -> bool:
    """The resume rule: an ok record for the same file (path, size, mtime) and the same
    settings, whose listed output files all exist."""
    if not rec or rec.get("status") != "ok" or rec.get("config_hash") != config_hash:
        return False
    if rec.get("source") != source:
        return False
    files = rec.get("files") or {}
    if not files:
        return False
    for entry in files.values():
        for rel in entry.values():
            if not os.path.isfile(os.path.join(out, *str(rel).split("/"))):
                return False
    return True


def _source_of(path: str) -> dict[str, Any]:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "bytes": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}


# ---------------------------------------------------------------------------------------------
# distributed
# ---------------------------------------------------------------------------------------------
@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @classmethod
    def from_env(cls) -> "_Dist":
        def env(name: str, default: int) -> int:
            try:
                return int(os.environ.get(name, default))
            except ValueError:
                raise UsageError(f"environment variable {name}={os.environ[name]!r} is not an integer") from None

        world = env("WORLD_SIZE", 1)
        rank = env("RANK", 0)
        local = env("LOCAL_RANK", rank)
        if world < 1 or not 0 <= rank < world:
            raise UsageError(f"bad distributed environment: RANK={rank}, WORLD_SIZE={world}")
        return cls(rank=rank, world=world, local_rank=local)

    def init(self, device: "torch.device") -> None:
        if self.world <= 1:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                try:  # binds NCCL to this rank's GPU (torch >= 2.3)
                    dist.init_process_group(backend, device_id=device)
                except TypeError:
                    dist.init_process_group(backend)
            else:
                dist.init_process_group(backend)
            self.initialized_here = True

    def gather(self, obj: Any) -> list[Any]:
        if self.world <= 1:
            return [obj]
        import torch.distributed as dist

        result: list[Any] = [None] * self.world
        dist.all_gather_object(result, obj)
        return result

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.initialized_here:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.initialized_here = False


def _resolve_device(spec: str, dist: _Dist) -> "torch.device":
    import torch

    spec = (spec or "auto").lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available here; use --device cpu")
        if spec == "cuda":
            index = dist.local_rank if dist.world > 1 else torch.cuda.current_device()
            spec = f"cuda:{index}"
        device = torch.device(spec)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) here")
        torch.cuda.set_device(device)
        return device
    try:
        return torch.device(spec)
    except RuntimeError:
        raise UsageError(f"--device {spec!r}: not a device; use cpu, cuda or cuda:N") from None


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def _parse_target(spec: Any, label_names: Optional[list[str]], num_classes: Optional[int]) -> Optional[Any]:
    if spec is None or str(spec).strip().lower() in ("", "pred", "predicted", "top"):
        return None
    text = str(spec).strip()
    if re.fullmatch(r"[+-]?\d+", text):
        index = int(text)
        if index < 0 or (num_classes is not None and index >= num_classes):
            raise UsageError(f"--target {index}: out of range for a model with {num_classes} classes")
        return index
    names = label_names or []
    if text in names:
        return text
    folded = [n for n in names if n.casefold() == text.casefold()]
    if len(folded) == 1:
        return folded[0]
    if not names:
        raise UsageError(f"--target {text!r}: this model has no label names; pass a class index or --labels FILE")
    shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
    raise UsageError(f"--target {text!r}: unknown label; choose pred, an index or one of: {shown}")


def _check_method_options(options: dict[str, dict[str, Any]], specs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Validate ``{method: {option: value}}`` against each method function's keyword arguments."""
    import inspect

    checked: dict[str, dict[str, Any]] = {}
    for method, values in (options or {}).items():
        if method not in specs:
            raise UsageError(f"--option {method}.*: {method!r} is not among the exported methods {list(specs)}")
        params = inspect.signature(specs[method].fn).parameters
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        allowed = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY or
                   (p.kind is p.POSITIONAL_OR_KEYWORD and n != "ctx")]
        for key in values:
            if not accepts_any and key not in allowed:
                raise UsageError(
                    f"--option {method}.{key}: {method} has no option {key!r}; its options: "
                    + (", ".join(allowed) or "none")
                )
        checked[method] = dict(values)
    return checked


def _resolve_methods(
    requested: Optional[Sequence[str]], default: Sequence[str], family: str,
    options: dict[str, dict[str, Any]],
) -> tuple[list[str], dict[str, Any], dict[str, dict[str, Any]]]:
    """The methods of a run: names (``default`` when none are requested, duplicates dropped),
    their registry specs, and the checked per-method options; problems are usage errors."""
    from .errors import UnsupportedMethodError
    from .methods import registry

    methods = list(dict.fromkeys(requested or default))
    try:
        specs = {m: registry.get(m, family) for m in methods}
    except UnsupportedMethodError as e:
        raise UsageError(str(e)) from None
    if not specs:
        raise UsageError(f"no method given; choose from {registry.names(family)}")
    return methods, specs, _check_method_options(options, specs)


def _probe(ex: Any, methods: list[str], method_options: dict[str, dict[str, Any]], target: Any,
           pre_kwargs: dict[str, Any], device: "torch.device", autocast_dtype: Any) -> None:
    """Explain one blank image before writing anything, so that a method that cannot work on
    this model (no attention gates, no attention found, bad options) is a usage error (exit 2)
    instead of the same failure repeated for every image."""
    import torch

    h, w = pre_kwargs["input_size"]
    x = torch.zeros(1, 3, int(h), int(w), device=device)
    try:
        with _autocast(autocast_dtype):
            ex.explain(x, method=methods, target=target, **method_options)
    except Exception as e:
        raise UsageError(
            f"cannot explain this model with {', '.join(methods)} (tried on a blank {h}x{w} image): "
            f"{type(e).__name__}: {e}"
        ) from None


def _versions() -> dict[str, str]:
    import numpy
    import torch

    from . import __version__

    out = {"vitexplain": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
           "python": sys.version.split()[0]}
    for name in ("timm", "cv2", "PIL"):
        try:
            module = __import__(name)
            out["opencv" if name == "cv2" else "pillow" if name == "PIL" else name] = str(module.__version__)
        except Exception:  # pragma: no cover
            pass
    return out


def _checkpoint_id(path: Optional[str]) -> Optional[dict[str, Any]]:
    if not path:
        return None
    st = os.stat(path)
    return {"path": os.path.abspath(path), "bytes": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}


def _zoo_weights_id(spec: str, info: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Size and mtime of a zoo model's weights file (so updated weights make outputs stale)."""
    if info.get("source") == "zoo":
        from .zoo import WEIGHTS_DIR

        path = WEIGHTS_DIR / f"{spec}.safetensors"
    elif info.get("source") == "file":
        path = Path(spec).with_suffix(".safetensors")
    else:
        return None
    try:
        return _checkpoint_id(str(path))
    except OSError:
        return None


def _digest(value: Any) -> Optional[str]:
    if value is None:
        return None
    return hashlib.sha1(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _model_id(spec: str) -> str:
    return os.path.abspath(spec) if spec.endswith(".json") and os.path.exists(spec) else spec


def _scores(logits: Any, multi_label: bool, k: int) -> Optional[tuple[list[list[float]], list[list[int]]]]:
    import torch

    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or k <= 0:
        return None
    z = logits.detach().float()
    probs = torch.sigmoid(z) if multi_label else torch.softmax(z, dim=1)
    values, indices = probs.topk(min(k, probs.shape[1]), dim=1)
    return values.cpu().tolist(), indices.cpu().tolist()


def _say(msg: str, bar: Any = None) -> None:
    if bar is not None:
        bar.write(msg, file=sys.stderr)
    else:
        print(msg, file=sys.stderr, flush=True)


def export(opts: ExportOptions, *, argv: Optional[Sequence[str]] = None) -> ExportResult:
    """Explain every input image and write overlays, maps, manifest, summary and gallery.

    Manifest record (one JSON object per line of ``manifest.jsonl``, sorted by ``key``)::

        {"key": "sub/a b.png",            # output key (relative to --out, posix)
         "input": "photos/sub/a b.png",   # the file as found
         "status": "ok" | "failed",
         "source": {"path": abs path, "bytes": int, "mtime_ns": int},
         "width": int, "height": int,     # decoded image size (pixels)
         "box": [left, top, right, bottom],  # region the model saw, original pixels
         "predictions": [{"index": int, "label": str|None, "score": float}, ...],  # top-k
         "score_kind": "softmax" | "sigmoid",
         "target": {"index": int, "label": str|None},
         "files": {"rollout": {"overlay": "sub/a b.png.rollout.png", "map": "...npy"}, ...},
         "error": str | None,
         "config_hash": str, "time": unix seconds, "rank": int}

    Resume: an image is skipped (counted as ``skipped``) when the manifest already holds an
    ``ok`` record with the same key whose ``source`` (absolute path, size, mtime) and
    ``config_hash`` (model, checkpoint, methods, target, crop, overlay settings, save_maps,
    amp) match and whose listed files all exist; ``overwrite`` redoes it anyway. Failed
    images are always retried.

    Args:
        opts: what to do (see :class:`ExportOptions`).
        argv: the command line, recorded in ``summary.json``.

    Returns:
        :class:`ExportResult` (exit code 0, or 1 when any image failed).

    Raises:
        UsageError: bad options or inputs, found before any output is written.
    """
    t_start = time.perf_counter()
    from .explainer import Explainer

    dist = _Dist.from_env()
    _check_batching(opts.batch_size, opts.workers)
    _check_overlay_style(opts.alpha, opts.colormap, opts.signed_colormap)
    device, autocast_dtype = _device_and_amp(opts.device, opts.amp, dist)
    out, items = _out_and_items(opts.out, opts.inputs)

    model, model_info = load_model(
        opts.model, checkpoint=opts.checkpoint, num_classes=opts.num_classes,
        model_args=opts.model_args, labels=opts.labels, device=device,
    )
    ex = Explainer(model)
    family = ex.family
    if family not in DEFAULT_METHODS:
        raise UsageError(
            f"--model {opts.model!r} is a {family} model; export explains classifiers (vit, cnn). "
            + ("Explain its captions word by word with `vitexplain caption` (or "
               "vx.Explainer(model).explain_caption(...))" if family == "caption" else "")
        )
    methods, specs, method_options = _resolve_methods(opts.methods, DEFAULT_METHODS[family], family,
                                                      opts.method_options)
    signed = {m: s.signed for m, s in specs.items()}
    label_names = ex.adapter.label_names
    num_classes = getattr(model, "num_classes", None)
    target = _parse_target(opts.target, label_names, num_classes if isinstance(num_classes, int) else None)
    pcfg = getattr(model, "pretrained_cfg", None) or {}
    multi_label = bool(pcfg.get("multi_label", False)) if isinstance(pcfg, dict) else False
    pre_kwargs = ex.adapter.preprocess_kwargs()
    if model_info.get("random_weights") and dist.rank == 0 and not opts.quiet:
        _say(f"vitexplain: warning: {opts.model} has random weights (no --checkpoint); the maps show plumbing, not meaning")

    _probe(ex, methods, method_options, target, pre_kwargs, device, autocast_dtype)

    config = {
        "model": _model_id(opts.model), "checkpoint": _checkpoint_id(opts.checkpoint),
        "weights": _zoo_weights_id(opts.model, model_info), "num_classes": opts.num_classes,
        "model_args": opts.model_args, "labels": _digest(label_names),
        "methods": methods, "method_options": method_options, "target": target, "crop": opts.crop, "alpha": opts.alpha,
        "colormap": opts.colormap, "signed_colormap": opts.signed_colormap, "max_side": opts.max_side,
        "topk": opts.topk, "save_maps": opts.save_maps, "amp": opts.amp,
    }
    run = _Run(
        command="export", out=out, items=items, dist=dist, device=device, autocast_dtype=autocast_dtype,
        pre_kwargs=pre_kwargs, config_hash=_config_hash(config), crop=opts.crop, max_side=opts.max_side,
        batch_size=opts.batch_size, workers=opts.workers, write_threads=opts.write_threads,
        overwrite=opts.overwrite, quiet=opts.quiet,
    )
    names = label_names or []

    def label(i: int) -> Optional[str]:
        return names[i] if 0 <= i < len(names) else None

    def process(x: "torch.Tensor", good: list[dict[str, Any]]) -> list[tuple[dict[str, Any], WriteFn]]:
        explanations = ex.explain(x, method=methods, target=target, **method_options)
        maps = {e.method: e.maps.float().cpu().numpy() for e in explanations}
        targets = explanations[0].targets.cpu().tolist()
        top = _scores(explanations[0].logits, multi_label, opts.topk)
        jobs: list[tuple[dict[str, Any], WriteFn]] = []
        for b, s in enumerate(good):
            fields: dict[str, Any] = {}
            if top is not None:
                fields["predictions"] = [{"index": int(i), "label": label(int(i)), "score": round(float(v), 6)}
                                         for v, i in zip(top[0][b], top[1][b])]
                fields["score_kind"] = "sigmoid" if multi_label else "softmax"
            fields["target"] = {"index": int(targets[b]), "label": label(int(targets[b]))}
            write = functools.partial(_write_overlays, key=s["key"], region=s["region"],
                                      maps={m: maps[m][b] for m in methods}, opts=opts, signed=signed)
            jobs.append((fields, write))
        return jobs

    def finish(all_stats: list[dict[str, Any]]) -> dict[str, Any]:
        records, summary = _write_summary(
            run, all_stats, t_start, opts=opts, argv=argv, config=config, methods=methods,
            model={**model_info, "family": family, "input_size": list(pre_kwargs["input_size"])},
        )
        if opts.html:
            from .viz.gallery import write_gallery

            write_gallery(out / GALLERY, records, methods=methods, title=f"vitexplain export: {opts.model}")
        return summary

    return _drive(run, process, finish, t_start)


# ---------------------------------------------------------------------------------------------
# the shared driver (export and caption)
# ---------------------------------------------------------------------------------------------
def _check_batching(batch_size: int, workers: int) -> None:
    """Usage errors of ``--batch-size`` and ``--workers``."""
    if batch_size < 1:
        raise UsageError("--batch-size must be >= 1")
    if workers < 0:
        raise UsageError("--workers must be >= 0")


def _check_overlay_style(alpha: float, *colormaps: str) -> None:
    """Usage errors of ``--alpha`` and colormap names."""
    if not 0.0 <= alpha <= 1.0:
        raise UsageError("--alpha must be in [0, 1]")
    from .viz.colormaps import colormap_lut

    for cmap in colormaps:
        try:
            colormap_lut(cmap)
        except ValueError as e:
            raise UsageError(f"colormap {cmap!r}: {e}") from None


def _device_and_amp(spec: str, amp: Optional[str], dist: _Dist) -> tuple["torch.device", Any]:
    """The device to run on and the autocast dtype (None without ``--amp``)."""
    import torch

    device = _resolve_device(spec, dist)
    autocast_dtype = None
    if amp:
        if amp not in ("bf16", "fp16"):
            raise UsageError(f"--amp {amp!r}: choose bf16 or fp16")
        if device.type != "cuda":
            raise UsageError(f"--amp {amp} needs a CUDA device (--device cuda); on {device.type} run without --amp")
        autocast_dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return device, autocast_dtype


def _out_and_items(out_arg: str, inputs: Sequence[str]) -> tuple[Path, list[InputItem]]:
    """The output folder (not created yet) and the discovered inputs."""
    out = Path(out_arg)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out_arg!r} exists and is not a folder")
    return out, discover_inputs(inputs, out)


def _config_hash(config: dict[str, Any]) -> str:
    """The settings digest recorded per image (resume: same hash, same outputs)."""
    return hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _autocast(autocast_dtype: Any) -> Any:
    import contextlib

    import torch

    return (torch.autocast(device_type="cuda", dtype=autocast_dtype) if autocast_dtype is not None
            else contextlib.nullcontext())


@dataclass
class _Run:
    """What the shared driver needs to know, whatever the command.

    Attributes:
        command: ``"export"`` or ``"caption"`` (progress bar and messages).
        out: output folder.
        items: every input of the run (all ranks), sorted by key.
        dist: the distributed setting.
        device: where the model runs.
        autocast_dtype: CUDA autocast dtype, or None.
        pre_kwargs: the model's :func:`vitexplain.data.images.preprocess` arguments.
        config_hash: digest of every setting that changes the outputs (the resume rule).
        crop, max_side, batch_size, workers, write_threads, overwrite, quiet: as the options.
    """

    command: str
    out: Path
    items: list[InputItem]
    dist: _Dist
    device: "torch.device"
    autocast_dtype: Any
    pre_kwargs: dict[str, Any]
    config_hash: str
    crop: bool
    max_side: int
    batch_size: int
    workers: int
    write_threads: int
    overwrite: bool
    quiet: bool


#: ``process(x, good)``: explain one decoded batch ``x`` (B, 3, H, W) (on the device, inside
#: autocast) whose samples are ``good`` (dicts with ``key``, ``region`` (h, w, 3) uint8 RGB,
#: ``width``, ``height``, ``box``); returns per sample the manifest fields to add and the
#: write job of its files. An exception fails the batch's images (reported, the run goes on).
ProcessFn = Callable[["torch.Tensor", list[dict[str, Any]]], list[tuple[dict[str, Any], WriteFn]]]


def _drive(
    run: _Run,
    process: ProcessFn,
    finish: Callable[[list[dict[str, Any]]], dict[str, Any]],
    t_start: float,
) -> ExportResult:
    """Run a command over its inputs: shard, resume, explain + write, merge, summarise.

    Args:
        run: the settings.
        process: explains a batch (see :data:`ProcessFn`).
        finish: on rank 0 after every rank is done, given every rank's stats: merge the
            manifest, write ``summary.json`` (and a gallery); returns the summary.
        t_start: ``time.perf_counter()`` when the command started.

    Returns:
        :class:`ExportResult` (exit code 1 when any image failed).

    Raises:
        KeyboardInterrupt: after an interruption, once finished files are recorded.
    """
    dist, out = run.dist, run.out
    dist.init(run.device)
    try:
        out.mkdir(parents=True, exist_ok=True)
        shard = run.items[dist.rank :: dist.world]
        previous = {} if run.overwrite else read_manifest(out)
        todo: list[tuple[InputItem, dict[str, Any]]] = []
        skipped = 0
        for item in shard:
            try:
                source = _source_of(item.path)
            except OSError:
                source = {"path": os.path.abspath(item.path), "bytes": None, "mtime_ns": None}
            if not run.overwrite and _is_current(previous.get(item.key), source, run.config_hash, out):
                skipped += 1
            else:
                todo.append((item, source))
        setup_s = time.perf_counter() - t_start
        crash: Optional[BaseException] = None
        try:
            stats = _run_shard(todo, run=run, process=process, skipped=skipped)
        except Exception as e:  # tell the other ranks instead of leaving them at the barrier
            if dist.world == 1:
                raise
            crash = e
            stats = {"crashed": f"rank {dist.rank}: {type(e).__name__}: {e}"}
        stats["setup_s"] = setup_s
        all_stats = dist.gather(stats)  # also the barrier: every rank has closed its part
        crashed = [s["crashed"] for s in all_stats if "crashed" in s]
        if crashed:
            if crash is not None:
                raise crash
            raise RuntimeError(f"{run.command} failed on another rank: " + "; ".join(crashed))
        summary: dict[str, Any] = {"rank": dist.rank, **stats}
        try:
            if dist.rank == 0:
                summary = finish(all_stats)
        finally:
            # Nobody exits before rank 0 has merged: launchers such as torchrun stop every
            # rank as soon as one exits non-zero (exit 1 = some images failed).
            dist.barrier()
        failed = sum(s["failed"] for s in all_stats)
        interrupted = any(s.get("interrupted") for s in all_stats)
    finally:
        dist.close()
    if interrupted:
        raise KeyboardInterrupt
    return ExportResult(exit_code=1 if failed else 0, summary=summary, out=out)


def _run_shard(
    todo: list[tuple[InputItem, dict[str, Any]]],
    *,
    run: _Run,
    process: ProcessFn,
    skipped: int,
) -> dict[str, Any]:
    """Process this rank's images; append their records to ``manifest.rank{r}.jsonl``."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from torch.utils.data import DataLoader

    dist, device = run.dist, run.device
    stats: dict[str, Any] = {"ok": 0, "failed": 0, "skipped": skipped, "failures": [],
                             "load_wait_s": 0.0, "explain_s": 0.0, "write_s": 0.0, "process_s": 0.0,
                             "interrupted": False}
    if not todo:
        return stats
    show_bar = not run.quiet and dist.rank == 0
    bar = None
    if show_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), unit="img", file=sys.stderr, dynamic_ncols=True,
                   desc=run.command if dist.world == 1 else f"{run.command} (rank 0 of {dist.world})")

    dataset = _ImageDataset([it.path for it, _ in todo], run.pre_kwargs, run.crop, run.max_side)
    loader = DataLoader(
        dataset, batch_size=run.batch_size, shuffle=False, num_workers=run.workers,
        collate_fn=_collate, pin_memory=device.type == "cuda",
        prefetch_factor=4 if run.workers > 0 else None,
    )
    writer = _Writer(run.out)
    part_path = run.out / _PART.format(rank=dist.rank)
    part = open(part_path, "ab")
    pool = ThreadPoolExecutor(max_workers=max(1, run.write_threads), thread_name_prefix="vitexplain-write")
    pending: deque[Future] = deque()
    max_pending = max(64, 4 * run.batch_size)

    def base_record(j: int) -> dict[str, Any]:
        item, source = todo[j]
        return {"key": item.key, "input": item.path, "status": None, "source": source,
                "error": None, "config_hash": run.config_hash, "rank": dist.rank}

    def emit(rec: dict[str, Any]) -> None:
        part.write(_json_line(rec))
        part.flush()
        if rec["status"] == "ok":
            stats["ok"] += 1
        else:
            stats["failed"] += 1
            if len(stats["failures"]) < 1000:
                stats["failures"].append({"input": rec["input"], "error": rec["error"]})
            _say(f"vitexplain: failed: {rec['error']}", bar)
        if bar is not None:
            bar.update(1)

    def drain(block_until: int) -> None:
        while pending and (len(pending) > block_until or pending[0].done()):
            rec, seconds = pending.popleft().result()
            stats["write_s"] += seconds
            emit(rec)

    t0 = time.perf_counter()
    try:
        it = iter(loader)
        while True:
            tw = time.perf_counter()
            try:
                x, good, bad = next(it)
            except StopIteration:
                break
            stats["load_wait_s"] += time.perf_counter() - tw
            for s in bad:
                rec = base_record(s["i"])
                rec.update(status="failed", error=s["error"], files={}, time=time.time())
                emit(rec)
            if x is None:
                continue
            for s in good:
                s["key"] = todo[s["i"]][0].key
            te = time.perf_counter()
            try:
                with _autocast(run.autocast_dtype):
                    jobs = process(x.to(device, non_blocking=True), good)
            except Exception as e:  # e.g. a method failing numerically: report, keep going
                for s in good:
                    rec = base_record(s["i"])
                    rec.update(status="failed", files={}, time=time.time(),
                               error=f"explaining {rec['input']} failed: {type(e).__name__}: {e}")
                    emit(rec)
                continue
            finally:
                stats["explain_s"] += time.perf_counter() - te
            for s, (fields, write) in zip(good, jobs):
                rec = base_record(s["i"])
                rec.update(width=s["width"], height=s["height"], box=s["box"])
                rec.update(fields)
                pending.append(pool.submit(_write_outputs, rec, write, writer))
            drain(max_pending)
        drain(0)
    except KeyboardInterrupt:
        stats["interrupted"] = True
        # Finish the images already explained (at most max_pending quick writes) so their
        # work is kept; a second Ctrl-C stops this too, and every write is atomic anyway.
        while pending:
            rec, _ = pending.popleft().result()
            emit(rec)
        _say("vitexplain: interrupted; finished files are kept, rerun the same command to resume", bar)
    finally:
        pool.shutdown(wait=True)
        part.close()
        if bar is not None:
            bar.close()
        stats["process_s"] = time.perf_counter() - t0
    return stats


def _merge_manifest(out: Path, items: list[InputItem]) -> list[dict[str, Any]]:
    """Rank 0: merge the manifest parts into ``manifest.jsonl``; returns its records.

    Kept: the latest record of each of this run's inputs, plus earlier successful records of
    other inputs written into the same folder.
    """
    latest = read_manifest(out)
    keys = {it.key for it in items}
    records = sorted((r for k, r in latest.items() if k in keys or r.get("status") == "ok"),
                     key=lambda r: r["key"])
    data = b"".join(_json_line(r) for r in records)
    _Writer(out).write(MANIFEST, data)
    for p in out.iterdir():
        if _PART_RE.match(p.name):
            p.unlink(missing_ok=True)
    return records


def _write_summary(
    run: _Run, all_stats: list[dict[str, Any]], t_start: float, *, opts: Any, argv: Optional[Sequence[str]],
    config: dict[str, Any], methods: list[str], model: dict[str, Any], extra: Optional[dict[str, Any]] = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Merge the manifest parts and write ``summary.json`` (both commands).

    Args:
        run: the run.
        all_stats: per-rank statistics from the driver.
        t_start: ``time.perf_counter()`` at the start of the command.
        opts: the command's options dataclass (recorded as ``arguments``).
        argv: the command line, or None.
        config: every setting that changes the outputs.
        methods: the methods run.
        model: the model record.
        extra: command-specific entries, placed after ``methods``.

    Returns:
        ``(manifest records, summary)``.
    """
    records = _merge_manifest(run.out, run.items)
    summary: dict[str, Any] = {
        **_run_summary(run.items, all_stats, t_start),
        "model": model,
        "methods": methods,
        **(extra or {}),
        **_run_environment(run),
        "arguments": asdict(opts),
        "argv": list(argv) if argv is not None else None,
        "config": config,
        "config_hash": run.config_hash,
        "manifest_records": len(records),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _atomic_text(run.out / SUMMARY, json.dumps(summary, indent=2, ensure_ascii=False, default=str) + "\n")
    return records, summary


def _run_summary(items: list[InputItem], all_stats: list[dict[str, Any]], t_start: float) -> dict[str, Any]:
    """The ``counts``, ``timings`` and ``failures`` of ``summary.json``."""
    ok = sum(s["ok"] for s in all_stats)
    failed = sum(s["failed"] for s in all_stats)
    skipped = sum(s["skipped"] for s in all_stats)
    process_s = max(s["process_s"] for s in all_stats)
    total_s = time.perf_counter() - t_start
    processed = ok + failed
    return {
        "counts": {"images": len(items), "ok": ok, "failed": failed, "skipped": skipped},
        "timings": {
            "total_s": round(total_s, 4),
            "setup_s": round(max(s["setup_s"] for s in all_stats), 4),
            "process_s": round(process_s, 4),
            "load_wait_s": round(sum(s["load_wait_s"] for s in all_stats), 4),
            "explain_s": round(sum(s["explain_s"] for s in all_stats), 4),
            "write_s": round(sum(s["write_s"] for s in all_stats), 4),
            "images_per_s": round(processed / process_s, 3) if process_s > 0 else None,
        },
        "failures": [f for s in all_stats for f in s["failures"]],
    }


def _run_environment(run: _Run) -> dict[str, Any]:
    """The ``device``, ``world_size`` and ``versions`` of ``summary.json``."""
    return {
        "device": str(run.device) if run.dist.world == 1 else f"{run.device.type} x {run.dist.world}",
        "world_size": run.dist.world,
        "versions": _versions(),
    }
