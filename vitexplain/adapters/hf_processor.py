"""What a Hugging Face image processor does to pixels, as :func:`vitexplain.data.images.preprocess` settings.

Used for a model folder's saved processor (``--model DIR``) and for the one given to ``vx.Explainer(captioner,
processor=...)``.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["image_processor_settings", "is_image_processor"]


def is_image_processor(proc: Any) -> bool:
    """Whether ``proc`` looks like a Hugging Face image processor (it says how it normalises or resizes)."""
    return callable(proc) and any(hasattr(proc, name)
                                  for name in ("image_mean", "do_normalize", "do_resize", "data_config"))


def image_processor_settings(proc: Any) -> dict[str, Any]:
    """Preprocessing settings (``input_size``, ``mean``, ``std``, ``crop_pct``, ``interpolation``, ``bgr``) of a
    Hugging Face image processor, as far as vitexplain's resize, center crop and normalisation express them. A
    processor that resizes to a fixed height and width without cropping squashes the image (``crop=False`` and
    ``--no-crop`` do that too; the default keeps the aspect ratio and cuts the center)."""
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
