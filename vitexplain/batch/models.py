"""Model loading for the batch commands (offline), and the model's part of the resume key.

``--model`` is a zoo name, the path of a zoo-format checkpoint ``.json``, a folder holding a Hugging
Face image classifier, an encoder-decoder captioner and its tokenizer (VisionEncoderDecoder, BLIP, GIT: the tokenizer
or processor attached as ``model.vx_tokenizer``) or a vision-language model and its processor (``save_pretrained``;
loaded offline with SDPA attention where the model's class has it, the processor attached as ``model.vx_processor``),
or a timm model name (created with
``pretrained=False``; weights from ``--checkpoint``). Every problem (unknown
name, unreadable or mismatching checkpoint, a zoo ``.json`` whose config cannot build a
model) is a :class:`~vitexplain.errors.UsageError`: the command exits with status 2 before
writing anything.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

__all__ = ["load_model", "load_hf_folder", "model_id", "checkpoint_id", "zoo_weights_id", "digest"]


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
        except Exception as e:
            raise UsageError(f"cannot create timm model {spec!r} with {model_args}: {e}") from None
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


def load_hf_folder(path: str) -> "nn.Module":
    """A Hugging Face image classifier, a captioner and its tokenizer, or a vision-language model and its processor,
    from a ``save_pretrained`` folder, offline.

    An image classifier (``AutoModelForImageClassification``: ViT, DeiT, DINOv2, BEiT, Swin, ResNet, ConvNeXt,
    ...) is loaded with ``attn_implementation="sdpa"`` where its class has SDPA attention; images are then
    preprocessed with the adapter's settings for that model type, overridden by the image processor saved in the
    folder where there is one (its mean, std, input size, crop and resampling: ``model.vx_preprocess``). A
    vision-language model is loaded with ``attn_implementation="sdpa"`` (its fused attention) and its processor is
    attached as ``model.vx_processor`` (what ``vx.Explainer(model, processor=...)`` takes). An encoder-decoder
    captioner (what vitexplain explains as the caption family) gets the folder's processor or tokenizer as
    ``model.vx_tokenizer`` and its image processor's settings as ``model.vx_preprocess``. A model class without
    SDPA attention (BLIP) loads with its own attention, which the capture records as it runs.

    Raises:
        UsageError: no ``config.json``, transformers missing, neither an image classifier nor an image-text-to-text
            model, or a vision-language model without a processor saved with it.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise UsageError(f"--model {path!r} is a folder without config.json; save the model there with "
                         "model.save_pretrained(DIR) and its processor with processor.save_pretrained(DIR)")
    try:
        import transformers
    except ImportError:
        raise UsageError(f"--model {path!r} is a Hugging Face model folder: pip install transformers") from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise UsageError(f"--model {path!r}: cannot read its config.json ({type(e).__name__}: {e})") from None
    classifier = transformers.AutoModelForImageClassification
    if type(config) in classifier._model_mapping:
        fused = getattr(classifier._model_mapping[type(config)], "_supports_sdpa", False)  # (CNNs have no attention)
        try:
            model, info = classifier.from_pretrained(str(folder), local_files_only=True, output_loading_info=True,
                                                     **({"attn_implementation": "sdpa"} if fused else {}))
        except Exception as e:
            raise UsageError(f"--model {path!r}: cannot load the image classifier ({type(e).__name__}: {e})") from None
        missing = sorted(info.get("missing_keys") or ())
        if missing:  # e.g. a backbone (ViTModel) saved there: transformers would make up a random classifier
            raise UsageError(
                f"--model {path!r}: its weights lack {missing[:4]}{' ...' if len(missing) > 4 else ''} of "
                f"{type(model).__name__} ({', '.join(getattr(config, 'architectures', None) or ['no architecture'])} "
                "was saved there), which transformers would initialise at random: `vitexplain export` explains "
                "a trained image classifier; save one with model.save_pretrained(DIR)")
        settings = _image_processor_settings(transformers, folder, path)
        if settings:
            model.vx_preprocess = settings  # read by vitexplain.adapters.preprocessing
        return model
    auto = transformers.AutoModelForImageTextToText
    if type(config) not in auto._model_mapping:
        raise UsageError(f"--model {path!r} holds a {type(config).__name__} ({config.model_type}), neither an image "
                         "classifier nor a vision-language (image-text-to-text) model: `vitexplain export` takes a "
                         "classifier folder, `vitexplain caption` a captioner or VLM folder")
    fused = getattr(auto._model_mapping[type(config)], "_supports_sdpa", False)  # (BLIP's attention is its own code)
    try:
        model = auto.from_pretrained(str(folder), local_files_only=True,
                                     **({"attn_implementation": "sdpa"} if fused else {}))
    except Exception as e:
        raise UsageError(f"--model {path!r}: cannot load the model ({type(e).__name__}: {e})") from None
    if _is_captioner(model):
        return _with_caption_tokenizer(transformers, model, folder, path)
    try:
        processor = transformers.AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise UsageError(f"--model {path!r}: no processor could be loaded from it ({type(e).__name__}: {e}); save "
                         "it next to the model with processor.save_pretrained(DIR)") from None
    if not hasattr(processor, "tokenizer") or not hasattr(processor, "image_processor"):
        raise UsageError(f"--model {path!r}: the processor saved there ({type(processor).__name__}) has no tokenizer "
                         "and image processor; save the model's full processor with processor.save_pretrained(DIR)")
    model.vx_processor = processor
    return model


def _is_captioner(model: "nn.Module") -> bool:
    """Whether vitexplain explains ``model`` as an encoder-decoder captioner (VisionEncoderDecoder, BLIP, GIT: it
    takes preprocessed images and a tokenizer) rather than as a vision-language model (which takes a processor)."""
    from ..adapters import adapter_for
    from ..errors import VitexplainError

    try:
        return adapter_for(model).family.name == "caption"
    except VitexplainError:  # not explainable: the Explainer says why, with the VLM path's words
        return False


def _with_caption_tokenizer(transformers: Any, model: "nn.Module", folder: Path, path: str) -> "nn.Module":
    """A captioner from a model folder with what its folder says about text and pixels: its processor (BLIP's, holding
    the tokenizer) or tokenizer as ``model.vx_tokenizer`` (what ``vx.Explainer(model, tokenizer=...)`` takes; the
    Explainer reads it by default), and its image processor's settings as ``model.vx_preprocess``.

    Raises:
        UsageError: the folder holds no tokenizer (the caption's words could not be named or encoded).
    """
    tokenizer = None
    for loader in (transformers.AutoProcessor, transformers.AutoTokenizer):
        try:
            tokenizer = loader.from_pretrained(str(folder), local_files_only=True)
        except Exception:  # (a folder without a processor class: its tokenizer alone, next)
            continue
        if callable(getattr(getattr(tokenizer, "tokenizer", tokenizer), "decode", None)):
            break
        tokenizer = None
    if tokenizer is None:
        raise UsageError(f"--model {path!r} is a captioner ({type(model).__name__}) saved without its tokenizer; save "
                         "it next to the model with tokenizer.save_pretrained(DIR) (or the processor's)")
    model.vx_tokenizer = tokenizer
    settings = _image_processor_settings(transformers, folder, path)
    if settings:
        model.vx_preprocess = settings  # read by vitexplain.adapters.preprocessing
    return model


def _image_processor_settings(transformers: Any, folder: Path, path: str) -> dict[str, Any]:
    """Preprocessing settings (``input_size``, ``mean``, ``std``, ``crop_pct``, ``interpolation``) of the image
    processor saved in a classifier folder (``preprocessor_config.json``), as far as vitexplain's resize, center crop
    and normalisation express them; ``{}`` when the folder holds none. A processor that resizes to a fixed height and
    width without cropping squashes the image: ``--no-crop`` does that too (the default keeps the aspect ratio and
    cuts the center).

    Raises:
        UsageError: the folder's processor config cannot be loaded.
    """
    if not any((folder / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")):
        return {}  # (a processor saved whole, BLIP's, keeps its image processor in processor_config.json)
    try:
        proc = transformers.AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise UsageError(f"--model {path!r}: cannot load its preprocessor_config.json ({type(e).__name__}: {e}); fix "
                         "or remove it (the model type's default preprocessing is used without it)") from None

    from ..data.images import data_config_kwargs, interpolation_name

    if isinstance(getattr(proc, "data_config", None), dict):  # TimmWrapperImageProcessor: timm's own data config
        return data_config_kwargs(proc.data_config)

    def field(size: Any, key: str) -> Optional[int]:
        value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
        return int(value) if value else None

    settings: dict[str, Any] = dict(_pixel_map(proc), bgr=bool(getattr(proc, "do_flip_channel_order", False)))
    interpolation = interpolation_name(getattr(proc, "resample", None))
    if interpolation is not None:
        settings["interpolation"] = interpolation
    if not getattr(proc, "do_resize", False):
        return settings
    size, crop = getattr(proc, "size", None), getattr(proc, "crop_size", None)
    height, width, short = field(size, "height"), field(size, "width"), field(size, "shortest_edge")
    crop_hw = (field(crop, "height"), field(crop, "width")) if crop is not None else (None, None)
    if getattr(proc, "do_center_crop", False) and all(crop_hw) and (short or height):
        settings.update(input_size=crop_hw, crop_pct=crop_hw[0] / (short or height))  # resize, then cut the center
    elif short and isinstance(getattr(proc, "crop_pct", None), float):  # ConvNeXt's: resize short / crop_pct, cut
        settings.update(input_size=(short, short), crop_pct=proc.crop_pct if short < 384 else 1.0)
    elif height and width:
        settings.update(input_size=(height, width), crop_pct=1.0)
    return settings


def _pixel_map(proc: Any) -> dict[str, tuple[float, ...]]:
    """``mean`` and ``std`` (per RGB channel, pixels in [0, 1]) of the affine map an image processor applies to the
    pixels: rescaling (``rescale_factor``; EfficientNet's ``rescale_offset`` subtracts 1 after it), normalising
    (``image_mean``, ``image_std``), and EfficientNet's ``include_top`` (divides by ``image_std`` again). A pixel
    value v in [0, 1] becomes (v - mean) / std."""
    def channels(value: Any, default: float) -> list[float]:
        if value is None:
            return [default] * 3
        return [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]

    scale = 255.0 * float(getattr(proc, "rescale_factor", 1 / 255)) if getattr(proc, "do_rescale", True) else 255.0
    offset = 1.0 if getattr(proc, "do_rescale", True) and getattr(proc, "rescale_offset", False) else 0.0
    normalize = bool(getattr(proc, "do_normalize", False))
    mean = channels(getattr(proc, "image_mean", None) if normalize else None, 0.0)
    std = channels(getattr(proc, "image_std", None) if normalize else None, 1.0)
    top = channels(getattr(proc, "image_std", None), 1.0) if getattr(proc, "include_top", False) else [1.0] * 3
    # processor: ((v * scale - offset) - m) / s / t  ==  (v - (m + offset) / scale) / (s * t / scale)
    return dict(mean=tuple((m + offset) / scale for m in mean), std=tuple(s * t / scale for s, t in zip(std, top)))


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
