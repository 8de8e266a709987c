"""Find, describe, save and load the bundled zoo checkpoints (offline).

A checkpoint is two files side by side: ``<name>.safetensors`` (the state dict, float32) and
``<name>.json`` (the config: ``name``, ``arch``, ``model_args``, ``pretrained_cfg``,
``training`` and ``metrics``). The bundled ones live in ``vitexplain/zoo/weights/`` (package data).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from ..errors import NotFoundError, UsageError

__all__ = ["names", "info", "load", "load_checkpoint", "save_checkpoint", "processor", "WEIGHTS_DIR"]

#: Directory of the bundled checkpoints.
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
_NAMES: tuple[str, ...] = ("shapes-vit", "shapes-cnn", "shapes-captioner", "shapes-sat", "shapes-vlm")
FORMAT_VERSION = 1

PathLike = Union[str, "os.PathLike[str]"]


def names() -> list[str]:
    """Names of the bundled zoo models: ``["shapes-vit", "shapes-cnn", "shapes-captioner", "shapes-sat",
    "shapes-vlm"]`` (``shapes-vlm`` needs transformers)."""
    return list(_NAMES)


def _check_name(name: str) -> None:
    if name not in _NAMES:
        raise NotFoundError(f"unknown zoo model {name!r}; available: {', '.join(names())}")


def _paths(name: str, weights_dir: PathLike | None) -> tuple[Path, Path]:
    folder = Path(weights_dir) if weights_dir is not None else WEIGHTS_DIR
    return folder / f"{name}.json", folder / f"{name}.safetensors"


def _read_config(json_path: Path, name: str) -> dict[str, Any]:
    if not json_path.is_file():
        raise NotFoundError(
            f"no checkpoint config for {name!r} at {json_path}; train one with "
            f"`python -m vitexplain.zoo.train {name} --out {json_path.parent}`"
        )
    with open(json_path, encoding="utf-8") as f:
        return json.load(f)


def info(name: str, *, weights_dir: PathLike | None = None) -> dict[str, Any]:
    """Describe a zoo model without building it.

    Args:
        name: one of :func:`names`.
        weights_dir: folder holding the checkpoint (default: the bundled weights).

    Returns:
        The JSON config (``arch``, ``model_args``, ``pretrained_cfg``, ``training`` with seed,
        steps and CPU time, ``metrics`` measured on held-out images, ``num_params``) plus
        ``file_size_mb`` of the safetensors file.
    """
    _check_name(name)
    json_path, st_path = _paths(name, weights_dir)
    cfg = _read_config(json_path, name)
    cfg["file_size_mb"] = round(st_path.stat().st_size / 2**20, 3) if st_path.is_file() else None
    return cfg


def _attach(model: nn.Module, cfg: dict[str, Any]) -> nn.Module:
    pcfg = dict(cfg["pretrained_cfg"])
    pcfg["input_size"] = tuple(pcfg["input_size"])
    pcfg["mean"] = tuple(pcfg["mean"])
    pcfg["std"] = tuple(pcfg["std"])
    model.pretrained_cfg = pcfg
    model.zoo_name = cfg["name"]
    if cfg.get("arch") == "llava":  # a Hugging Face VLM carries its processor (rebuilt offline)
        from .vlm import build_processor

        model.vx_processor = build_processor(cfg["model_args"])
    return model


# below this many parameters the ordinary init is quicker than building on the meta device
_META_MIN_NUMEL = 4_000_000


def build_loaded(create: Callable[[], nn.Module], state: Optional[dict[str, torch.Tensor]]) -> Optional[nn.Module]:
    """The model with ``state`` loaded, built without its random initialisation, or None.

    ``create()`` runs on the meta device (no memory, no init: timm's truncated-normal init of
    a ViT-S takes longer than loading its weights), then the checkpoint's tensors are assigned.
    None (build it the ordinary way) when that cannot give the same model: no checkpoint,
    keys or shapes that differ (the ordinary path reports them), tied weights, or buffers that
    are not in the state dict (e.g. Swin's relative position index, rotary tables); and for
    models under 4M parameters, whose random init is quicker than the meta device's fixed
    cost (measured: 9 ms vs 35 ms for shapes-vit, 234 ms vs 88 ms for a ViT-S, one thread).
    """
    if state is None or sum(t.numel() for t in state.values()) < _META_MIN_NUMEL:
        return None
    with torch.device("meta"):
        model = create()
    expected = model.state_dict()
    if set(expected) != set(state) or any(tuple(state[k].shape) != tuple(t.shape) for k, t in expected.items()):
        return None
    params = list(model.named_parameters(remove_duplicate=False))
    if len({id(p) for _, p in params}) != len(params):
        return None
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True, assign=True)
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        return None
    return model


def load_checkpoint(path: PathLike, device: str | torch.device = "cpu") -> nn.Module:
    """Load a checkpoint written by :func:`save_checkpoint` (or the training script).

    Args:
        path: the ``.json`` or ``.safetensors`` file (the other one must sit next to it).
        device: where to put the model.

    Returns:
        The model in eval mode, with ``pretrained_cfg`` (timm-style dict) and ``zoo_name`` set.
    """
    from safetensors.torch import load_file

    from .models import build

    p = Path(path)
    json_path, st_path = p.with_suffix(".json"), p.with_suffix(".safetensors")
    cfg = _read_config(json_path, p.stem)
    if not st_path.is_file():
        raise NotFoundError(f"checkpoint weights missing: {st_path}; train them with `python -m vitexplain.zoo.train`")
    if cfg.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
        raise UsageError(f"{json_path} has format_version {cfg['format_version']}; upgrade vitexplain")
    state = load_file(str(st_path), device="cpu")
    model = build_loaded(lambda: build(cfg), state)
    if model is None:
        model = build(cfg)
        model.load_state_dict(state, strict=True)
    model = _attach(model, cfg)
    return model.to(device).eval()


def load(name: str, device: str | torch.device = "cpu", *, weights_dir: PathLike | None = None) -> nn.Module:
    """Load a bundled zoo model, offline.

    Args:
        name: one of :func:`names` (``"shapes-vit"``, ``"shapes-cnn"``, ``"shapes-captioner"``,
            ``"shapes-sat"``).
        device: where to put the model.
        weights_dir: folder to load from instead of the bundled weights (same file names).

    Returns:
        An eval-mode model with ``model.pretrained_cfg`` (``input_size``, ``mean``, ``std``,
        ``interpolation``, ``crop_pct``, ``label_names``, ``num_classes``) and ``model.zoo_name``.
        Classifiers take (B, 3, 64, 64) images normalised with ``vx.data.MEAN/STD`` and return
        (B, 5) multi-label logits over ``vx.data.SHAPES``. ``shapes-vlm`` is a Hugging Face
        ``LlavaForConditionalGeneration`` (SDPA attention) with its processor attached as
        ``model.vx_processor`` (also :func:`processor`); see :mod:`vitexplain.zoo.vlm`.

    Raises:
        KeyError: unknown name (the message lists :func:`names`).
        FileNotFoundError: the checkpoint files are missing.
    """
    _check_name(name)
    json_path, _ = _paths(name, weights_dir)
    return load_checkpoint(json_path, device=device)


def processor(name: str | nn.Module, *, weights_dir: PathLike | None = None) -> Any:
    """The processor of a zoo vision-language model (``shapes-vlm``), built offline.

    Args:
        name: ``"shapes-vlm"``, or a model returned by :func:`load` / :func:`load_checkpoint`
            (its ``vx_processor``).
        weights_dir: folder holding the checkpoint config (default: the bundled weights).

    Returns:
        A ``transformers.LlavaProcessor`` (word-level tokenizer over the shapes vocabulary and a
        ``CLIPImageProcessor`` with ``vx.data.MEAN/STD``); pass it as ``vx.Explainer(model,
        processor=...)``.

    Raises:
        UsageError: the model is not a zoo vision-language model, or transformers is missing.
        NotFoundError: unknown zoo name.
    """
    if isinstance(name, nn.Module):
        proc = getattr(name, "vx_processor", None)
        if proc is None:
            raise UsageError("this model carries no processor: only zoo vision-language models "
                             "(vx.zoo.load('shapes-vlm')) do")
        return proc
    _check_name(name)
    cfg = _read_config(_paths(name, weights_dir)[0], name)
    if cfg.get("arch") != "llava":
        raise UsageError(f"{name!r} is not a vision-language model and has no processor; "
                         f"try vx.zoo.processor('shapes-vlm')")
    from .vlm import build_processor

    return build_processor(cfg["model_args"])


def save_checkpoint(model: nn.Module, config: dict[str, Any], out_dir: PathLike) -> Path:
    """Write ``<name>.safetensors`` and ``<name>.json`` into ``out_dir``.

    Args:
        model: the trained model.
        config: the zoo config; must hold ``name``, ``arch``, ``model_args``; ``pretrained_cfg``
            is filled in, and ``num_params`` and ``format_version`` are added.
        out_dir: destination folder (created if needed).

    Returns:
        Path of the JSON file.
    """
    from safetensors.torch import save_file

    from .models import pretrained_cfg

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = config["name"]
    cfg = dict(config)
    cfg["format_version"] = FORMAT_VERSION
    cfg["pretrained_cfg"] = pretrained_cfg(cfg)
    cfg["num_params"] = int(sum(p.numel() for p in model.parameters()))
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / f"{name}.safetensors"), metadata={"name": name, "format": "pt"})
    with open(out / f"{name}.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=False)
        f.write("\n")
    return out / f"{name}.json"
