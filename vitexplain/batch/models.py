"""Model loading for the batch commands (offline), and the model's part of the resume key.

``--model`` is a zoo name, the path of a zoo-format checkpoint ``.json``, a Hugging Face ``save_pretrained`` folder
(an image classifier, a captioner and its tokenizer, or a vision-language model and its processor:
:mod:`vitexplain.batch.hf_folder`), or a timm model name (created with ``pretrained=False``; weights from
``--checkpoint``). Every problem (unknown name, unreadable or mismatching checkpoint, a zoo ``.json`` whose config
cannot build a model) is a :class:`~vitexplain.errors.UsageError`: the command exits with status 2 before writing
anything.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..errors import UsageError
from .hf_folder import load_hf_folder

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

__all__ = ["load_model", "model_id", "checkpoint_id", "zoo_weights_id", "digest"]


def _read_state_dict(path: str) -> dict[str, Any]:
    import torch

    p = Path(path)
    if p.is_dir():
        raise UsageError(f"--checkpoint {path!r} is a folder; pass the weights file in it "
                         "(.safetensors, or .pt/.pth)")
    if not p.is_file():
        raise UsageError(f"--checkpoint {path!r}: no such file")
    try:
        if p.suffix.lower() == ".safetensors":
            from safetensors.torch import load_file

            obj: Any = load_file(str(p), device="cpu")
        else:
            obj = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:
        if type(e).__name__ == "UnpicklingError" and "Unsupported global" in str(e):
            raise UsageError(
                f"--checkpoint {path!r} holds pickled Python objects besides tensors (e.g. a whole model saved "
                "with torch.save(model)), which vitexplain does not load (unpickling can run code): save "
                "model.state_dict() instead, or convert it to .safetensors"
            ) from None
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
        checkpoint: state dict file (see :class:`~vitexplain.batch.export.ExportOptions`).
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
    from .. import zoo
    from ..zoo.hub import build_loaded

    for flag, value in (("--checkpoint", checkpoint), ("--labels", labels)):
        if value is not None and not str(value).strip():  # `--checkpoint "$UNSET"`: not the same as leaving it out
            raise UsageError(f"{flag} is empty; name the file, or leave {flag} out")
    info: dict[str, Any] = {"name": spec, "checkpoint": checkpoint, "random_weights": False}
    model_args = dict(model_args or {})
    if os.path.isdir(spec):
        if checkpoint or model_args or num_classes is not None:
            raise UsageError("--checkpoint, --num-classes and --model-arg apply to timm models, not to a model folder")
        info["source"] = "folder"
        return load_hf_folder(spec).eval().to(device), info
    if spec in zoo.names() or spec.endswith(".json"):
        if model_args or num_classes is not None:
            raise UsageError("--num-classes and --model-arg apply to timm models, not to zoo checkpoints")
        try:
            if spec in zoo.names():
                model, info["source"] = zoo.load(spec), "zoo"
            else:
                model, info["source"] = zoo.load_checkpoint(spec), "file"
        except Exception as e:  # a zoo .json is user input: any failure to build it is a usage error
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            hint = ("" if spec in zoo.names() else "; check the checkpoint's config (arch, model_args) "
                    "and that its .safetensors file sits next to it")
            raise UsageError(f"--model {spec!r}: cannot load it ({type(e).__name__}: {detail}){hint}") from None
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
        if "pretrained" in model_args:
            raise UsageError(
                "--model-arg pretrained: pretrained weights cannot be downloaded (vitexplain runs "
                f"offline); drop it and pass the weights of {spec!r} as --checkpoint FILE")
        state = _read_state_dict(checkpoint) if checkpoint else None
        if num_classes is None and state is not None:
            num_classes = _head_size(state)
        if num_classes is not None:
            model_args["num_classes"] = int(num_classes)
        try:
            model = build_loaded(lambda: timm.create_model(spec, pretrained=False, **model_args), state)
            loaded = model is not None
            if model is None:
                model = timm.create_model(spec, pretrained=False, **model_args)
        except Exception as e:  # (torch's errors carry a C++ backtrace after their first line)
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"cannot create timm model {spec!r} with {model_args}: {detail}") from None
        info["source"] = "timm"
        _fix_input_size(model)
        if state is not None and not loaded:
            _load_state(model, state, checkpoint)
        elif state is None:
            info["random_weights"] = True
    if labels:
        try:
            text = Path(labels).read_text(encoding="utf-8-sig")  # (-sig: drops the byte order mark Notepad writes)
        except OSError as e:
            raise UsageError(f"--labels {labels!r}: cannot read it ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise UsageError(f"--labels {labels!r} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); "
                             "save it as UTF-8, one class name per line") from None
        names = [line.strip() for line in text.splitlines() if line.strip()]
        classes = getattr(model, "num_classes", None)
        if isinstance(classes, int) and classes > 0 and len(names) != classes:  # else names land on wrong classes
            raise UsageError(f"--labels {labels!r} has {len(names)} names (non-empty lines) but the model has "
                             f"{classes} classes; give one name per class, in class-index order")
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


def checkpoint_id(path: Optional[str]) -> Optional[dict[str, Any]]:
    """``{"path", "bytes", "mtime_ns"}`` of a weights file (None without one)."""
    if not path:
        return None
    st = os.stat(path)
    return {"path": os.path.abspath(path), "bytes": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}


def zoo_weights_id(spec: str, info: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Size and mtime of a zoo model's weights file (so updated weights make outputs stale)."""
    if info.get("source") == "folder":  # every file of the folder (weights, config, processor)
        files = sorted(p for p in Path(spec).rglob("*") if p.is_file())
        return {"path": os.path.abspath(spec), "files": [[p.relative_to(spec).as_posix(), *_stat(p)] for p in files]}
    if info.get("source") == "zoo":
        from ..zoo import WEIGHTS_DIR

        path = WEIGHTS_DIR / f"{spec}.safetensors"
    elif info.get("source") == "file":
        path = Path(spec).with_suffix(".safetensors")
    else:
        return None
    try:
        return checkpoint_id(str(path))
    except OSError:
        return None


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [int(st.st_size), int(st.st_mtime_ns)]


def digest(value: Any) -> Optional[str]:
    """A short digest of a JSON-able value (e.g. the label names), None for None."""
    if value is None:
        return None
    return hashlib.sha1(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def model_id(spec: str) -> str:
    """``--model`` as recorded in the resume key: a checkpoint ``.json`` or a model folder by absolute path."""
    return os.path.abspath(spec) if (spec.endswith(".json") and os.path.exists(spec)) or os.path.isdir(spec) else spec
