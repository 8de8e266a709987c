"""Hugging Face ``save_pretrained`` folders as ``--model DIR`` (offline): an image classifier, a captioner and its
tokenizer, or a vision-language model and its processor, with the preprocessing their saved image processor sets."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["load_hf_folder"]


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
    ``model.vx_tokenizer`` and its image processor's settings as ``model.vx_preprocess``. A model without SDPA
    attention (BLIP; PaliGemma 2, whose Gemma 2 refuses it) loads with its own attention, which the capture records.

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
        try:
            model, info = _load(classifier, folder, config, output_loading_info=True)
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
    try:
        model = _load(auto, folder, config)
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


def _load(auto: Any, folder: Path, config: Any, **kwargs: Any) -> Any:
    """``auto.from_pretrained(folder)`` offline with SDPA attention where the model has it; with the model's own
    attention where its class has none (BLIP, CNNs) or one of its parts refuses SDPA (PaliGemma 2's Gemma 2: transformers
    raises for it), which the capture records as it runs.

    Raises:
        Exception: transformers' error when the model cannot be loaded either way (the first one's).
    """
    if getattr(auto._model_mapping[type(config)], "_supports_sdpa", False):
        try:
            return auto.from_pretrained(str(folder), local_files_only=True, attn_implementation="sdpa", **kwargs)
        except Exception as first:  # (a part without SDPA; anything else fails again below, with the first error)
            try:
                return auto.from_pretrained(str(folder), local_files_only=True, **kwargs)
            except Exception:
                raise first from None
    return auto.from_pretrained(str(folder), local_files_only=True, **kwargs)


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
        UsageError: the folder holds no tokenizer (the caption's words could not be named or encoded), or it holds a
            VisionEncoderDecoder without its image processor (its pixel statistics would be guessed).
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
    elif type(model).__name__ == "VisionEncoderDecoderModel":
        # BLIP's and GIT's pixels are fixed by their model type (their processors' CLIP statistics); a
        # VisionEncoderDecoder's are whatever it was trained with (0.5 for ViT-GPT2 and TrOCR, ImageNet's for an
        # encoder fine-tuned with its own processor): the adapter's 0.5 would be a guess, used on every image
        raise UsageError(
            f"--model {path!r} is a VisionEncoderDecoder captioner saved without its image processor "
            "(preprocessor_config.json), and its pixel statistics (mean, std, resizing) depend on how it was trained, "
            "not on its model type; save the processor it was trained with next to it "
            "(processor.save_pretrained(DIR)), or write one with the right statistics, e.g. "
            "transformers.ViTImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(DIR)")
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
    from ..adapters.hf_processor import image_processor_settings  # (here: the adapters import torch)

    return image_processor_settings(proc)
