"""Model preprocessing with crop bookkeeping (decoding is :mod:`vitexplain.data.decoding`).

:func:`preprocess` turns images into a normalised ``(B, 3, H, W)`` float32 tensor with
timm's evaluation transform (shorter side resized to ``int(size / crop_pct)``, center
crop) and returns, per image, the :class:`CropBox` the model saw, in original pixel
coordinates. :func:`crop_region` cuts that region out of the image so a map can be
overlaid on exactly what the model saw; :func:`paste_map` instead places a map back on
the full image.

:func:`load_image` (and :class:`~vitexplain.errors.ImageLoadError`) are re-exported from
:mod:`vitexplain.data.decoding`, where they are defined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
from PIL import Image

from ..errors import ImageLoadError, InputError, UsageError
from .arrays import map_to_numpy
from .decoding import DEFAULT_MAX_PIXELS, ImageSource, load_image, to_rgb

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "ImageLoadError",
    "DEFAULT_MAX_PIXELS",
    "MAX_RESIZE_INPUTS",
    "ImageSource",
    "load_image",
    "CropBox",
    "preprocess",
    "preprocess_kwargs",
    "data_config_kwargs",
    "interpolation_name",
    "check_resizable",
    "crop_region",
    "seen_region",
    "paste_map",
]

#: :func:`preprocess` (with ``crop=True``) refuses to resize an image to more pixels than
#: this many model inputs (at the resize scale, ``input_size / crop_pct``) or the image
#: itself, whichever is larger. A normal photo is only ever shrunk or mildly enlarged; a
#: 1 x 400,000 px strip would become a 73 x 29,200,000 px (8 GB) intermediate for a 64 px
#: model. This allows aspect ratios up to 64:1 for small images.
MAX_RESIZE_INPUTS: int = 64


_R = getattr(Image, "Resampling", Image)  # Pillow < 9.1 has the constants on Image
_PIL_RESAMPLE = {
    "nearest": _R.NEAREST,
    "bilinear": _R.BILINEAR,
    "bicubic": _R.BICUBIC,
    "lanczos": _R.LANCZOS,
    "box": _R.BOX,
    "hamming": _R.HAMMING,
}


def interpolation_name(resample: Any) -> Optional[str]:
    """The :func:`preprocess` ``interpolation`` of a Pillow resampling filter (an image processor's ``resample``,
    stored as its integer value), or None when it is none of them."""
    for name, value in _PIL_RESAMPLE.items():
        if isinstance(resample, int) and not isinstance(resample, bool) and int(value) == int(resample):
            return name
    return None


@dataclass(frozen=True)
class CropBox:
    """The region of an original image that a model saw, in original pixel coordinates.

    Coordinates are continuous pixel edges: the full image is ``(0, 0, W, H)``. They are
    floats because resizing rarely maps crop edges onto whole pixels; they may extend
    past the image when the crop is larger than the resized image (zero padding, as in
    torchvision's ``CenterCrop``).

    Attributes:
        left: Left edge (x).
        top: Top edge (y).
        right: Right edge (x), exclusive.
        bottom: Bottom edge (y), exclusive.
        image_size: ``(H, W)`` of the original image.
    """

    left: float
    top: float
    right: float
    bottom: float
    image_size: tuple[int, int]

    @property
    def width(self) -> float:
        """Width of the box in original pixels."""
        return self.right - self.left

    @property
    def height(self) -> float:
        """Height of the box in original pixels."""
        return self.bottom - self.top

    def to_int(self) -> tuple[int, int, int, int]:
        """``(left, top, right, bottom)`` rounded to whole pixels (as :func:`crop_region` cuts)."""
        return (round(self.left), round(self.top), round(self.right), round(self.bottom))


def _as_pil(image: Any) -> Image.Image:
    if isinstance(image, Image.Image):  # same mode conversion as load_image (alpha on white, ...)
        return image if image.mode == "RGB" else Image.fromarray(to_rgb(image), "RGB")
    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise UsageError(
            f"expected an (H, W, 3) uint8 RGB image (e.g. from load_image), got "
            f"shape {arr.shape} dtype {arr.dtype}"
        )
    return Image.fromarray(np.ascontiguousarray(arr), mode="RGB")


def _resize_size(h: int, w: int, scale: tuple[int, int]) -> tuple[int, int]:
    """(new_h, new_w) exactly as timm's eval transform computes it."""
    if scale[0] == scale[1]:  # torchvision Resize(int): shorter side -> scale, truncate the other
        s = scale[0]
        if w <= h:
            return int(s * h / w), s
        return s, int(s * w / h)
    ratio = min(h / scale[0], w / scale[1])  # timm ResizeKeepRatio(longest=0)
    return round(h / ratio), round(w / ratio)


def _center_offset(size: int, crop: int) -> int:
    """Offset of a center crop along one axis, as torchvision's center_crop (incl. padding)."""
    if crop > size:
        return -((crop - size) // 2)
    return int(round((size - crop) / 2.0))


def check_resizable(
    height: int, width: int, *, input_size: Sequence[int], crop_pct: float | None = 1.0,
    advice: str = "Crop or pad it first, or resize it whole without cropping (crop=False, --no-crop)",
    **_: Any,
) -> tuple[int, int]:
    """Check that :func:`preprocess` (``crop=True``) can resize a ``height`` x ``width`` image,
    without touching a pixel; see :data:`MAX_RESIZE_INPUTS`.

    Args:
        height, width: the image's size.
        input_size: the model's ``(H, W)``; ``crop_pct`` as for :func:`preprocess` (other
            :func:`preprocess_kwargs` are accepted and ignored).
        advice: what the error tells the user to do.

    Returns:
        ``(h, w)`` of the resized image (before the center crop).

    Raises:
        InputError: the resized image would exceed the limit (aspect ratio too extreme).
    """
    out_h, out_w = (int(v) for v in tuple(input_size)[-2:])
    pct = 1.0 if crop_pct is None else float(crop_pct)
    scale = (math.floor(out_h / pct), math.floor(out_w / pct))
    h1, w1 = _resize_size(height, width, scale)
    if h1 * w1 > max(height * width, MAX_RESIZE_INPUTS * scale[0] * scale[1]):
        raise InputError(
            f"a {width}x{height} image cannot be resized for this model: its shorter side would become "
            f"{min(h1, w1)} px and the resized image {w1}x{h1} = {h1 * w1:,} pixels (aspect ratio "
            f"{max(height, width) / min(height, width):,.0f}:1 is too extreme). {advice}"
        )
    return h1, w1


def preprocess(
    images: Any,
    *,
    input_size: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    crop_pct: float | None = 1.0,
    interpolation: str = "bicubic",
    crop: bool = True,
    bgr: bool = False,
) -> tuple[torch.Tensor, list[CropBox]]:
    """Resize, center-crop and normalise images for a model, recording the crop.

    With ``crop=True`` this is timm's evaluation transform (``transforms_imagenet_eval``,
    crop mode ``"center"``) on Pillow images: the shorter side is resized to
    ``int(size / crop_pct)`` (non-square ``input_size``: the image is scaled so that it
    covers ``input_size / crop_pct``, keeping its aspect ratio), then the center
    ``input_size`` is cut out. With ``crop=False`` every image is resized straight to
    ``input_size`` (aspect ratio not kept, nothing cut off). Then pixels are scaled to
    ``[0, 1]`` and normalised with ``(x - mean) / std``.

    Args:
        images: One ``(H, W, 3)`` uint8 RGB array or ``PIL.Image``, or a sequence of them
            (sizes may differ), or a ``(B, H, W, 3)`` uint8 array.
        input_size: Model input ``(H, W)``; timm's ``(3, H, W)`` is accepted too.
        mean: Per-channel mean (RGB), in ``[0, 1]`` units.
        std: Per-channel standard deviation (RGB).
        crop_pct: Fraction of the resized shorter side that is kept (timm's
            ``crop_pct``). ``None`` means 1.0 here (no margin) -- unlike timm, where it
            means 0.875; pass the value of the model's resolved data config.
        interpolation: ``"bicubic"``, ``"bilinear"``, ``"nearest"``, ``"lanczos"``,
            ``"box"`` or ``"hamming"`` (Pillow resampling, antialiased).
        crop: ``False`` resizes to ``input_size`` without cropping.
        bgr: reverse the channels after normalising (``mean`` and ``std`` are still RGB): the model takes BGR
            input (Hugging Face MobileViT's image processor flips the channel order).

    Returns:
        ``(x, boxes)``: ``x`` is a ``(B, 3, H, W)`` float32 CPU tensor; ``boxes[i]`` is the
        :class:`CropBox` of image ``i`` in its original pixel coordinates.

    Raises:
        UsageError: Bad image arrays, sizes, ``crop_pct`` or interpolation name.
        InputError: An image whose aspect ratio is too extreme to resize (see
            :data:`MAX_RESIZE_INPUTS`).
    """
    import torch

    size = tuple(int(s) for s in input_size)
    if len(size) == 3:
        if size[0] != 3:
            raise UsageError(f"input_size {tuple(input_size)} must have 3 channels")
        size = size[1:]
    if len(size) != 2 or min(size) <= 0:
        raise UsageError(f"input_size must be (H, W) or (3, H, W), got {tuple(input_size)}")
    out_h, out_w = size
    pct = 1.0 if crop_pct is None else float(crop_pct)
    if not (pct > 0 and math.isfinite(pct)):
        raise UsageError(f"crop_pct must be a positive number, got {crop_pct!r}")
    try:
        resample = _PIL_RESAMPLE[interpolation.lower()]
    except (KeyError, AttributeError):
        raise UsageError(
            f"unknown interpolation {interpolation!r}; choose from {sorted(_PIL_RESAMPLE)}"
        ) from None
    mean_t = torch.as_tensor(tuple(mean), dtype=torch.float32).view(-1, 1, 1)
    std_t = torch.as_tensor(tuple(std), dtype=torch.float32).view(-1, 1, 1)
    if mean_t.numel() != 3 or std_t.numel() != 3:
        raise UsageError("mean and std need 3 values (RGB)")

    if isinstance(images, Image.Image) or (isinstance(images, np.ndarray) and images.ndim == 3):
        images = [images]
    tensors: list[torch.Tensor] = []
    boxes: list[CropBox] = []
    for image in images:
        pil = _as_pil(image)
        w0, h0 = pil.size
        if not crop:
            res = pil.resize((out_w, out_h), resample)
            box = CropBox(0.0, 0.0, float(w0), float(h0), (h0, w0))
        else:
            h1, w1 = check_resizable(h0, w0, input_size=size, crop_pct=pct)
            res = pil if (h1, w1) == (h0, w0) else pil.resize((w1, h1), resample)
            top, left = _center_offset(h1, out_h), _center_offset(w1, out_w)
            if (top, left, out_h, out_w) != (0, 0, h1, w1):
                res = res.crop((left, top, left + out_w, top + out_h))  # zero-pads outside
            sx, sy = w0 / w1, h0 / h1
            box = CropBox(left * sx, top * sy, (left + out_w) * sx, (top + out_h) * sy, (h0, w0))
        arr = np.asarray(res, dtype=np.uint8)
        x = torch.from_numpy(arr.copy()).permute(2, 0, 1).to(torch.float32).div(255)
        x = x.sub_(mean_t).div_(std_t)
        tensors.append(x.flip(0) if bgr else x)
        boxes.append(box)
    if not tensors:
        raise UsageError("preprocess got no images")
    return torch.stack(tensors), boxes


def preprocess_kwargs(model: Any) -> dict[str, Any]:
    """Keyword arguments for :func:`preprocess` from a model's timm data config.

    Uses ``timm.data.resolve_data_config(model=model)``, which falls back to timm's
    defaults (224, ImageNet mean/std, crop_pct 0.875, bicubic) for models without a
    ``pretrained_cfg``.

    Args:
        model: A ``torch.nn.Module`` (timm models carry their config).

    Returns:
        ``{"input_size": (H, W), "mean", "std", "crop_pct", "interpolation"}``.
    """
    from timm.data import resolve_data_config

    return data_config_kwargs(resolve_data_config(model=model))


def data_config_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for :func:`preprocess` from a timm data config or ``pretrained_cfg`` (``input_size``, ``mean``,
    ``std``, ``crop_pct``, ``interpolation``; timm's defaults for the keys it lacks)."""
    from timm.data import resolve_data_config

    if not {"input_size", "mean", "std"} <= set(cfg):
        cfg = resolve_data_config(pretrained_cfg=cfg, verbose=False)
    return {
        "input_size": tuple(cfg["input_size"][-2:]),
        "mean": tuple(cfg["mean"]),
        "std": tuple(cfg["std"]),
        "crop_pct": cfg.get("crop_pct") or 0.875,
        "interpolation": cfg.get("interpolation", "bicubic"),
    }


def crop_region(image: np.ndarray, box: CropBox) -> np.ndarray:
    """Cut out the region the model saw, to overlay a map on exactly that view.

    The box is rounded to whole pixels (:meth:`CropBox.to_int`); parts outside the
    image (possible when ``crop_pct > 1``) are filled with black, as in preprocessing.

    Args:
        image: The original ``(H, W, 3)`` uint8 RGB image the box refers to.
        box: The image's box from :func:`preprocess`.

    Returns:
        ``(h, w, 3)`` uint8 RGB copy of the region.
    """
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:
        raise UsageError(f"expected an (H, W, 3) uint8 RGB image, got {arr.shape} {arr.dtype}")
    if tuple(arr.shape[:2]) != tuple(box.image_size):
        raise UsageError(f"image is {arr.shape[:2]} but the box belongs to an image of {box.image_size}")
    l, t, r, b = box.to_int()
    h, w = arr.shape[:2]
    out = np.zeros((max(b - t, 0), max(r - l, 0), 3), np.uint8)
    sl, st, sr, sb = max(l, 0), max(t, 0), min(r, w), min(b, h)
    if sr > sl and sb > st:
        out[st - t : sb - t, sl - l : sr - l] = arr[st:sb, sl:sr]
    return out


def seen_region(image: np.ndarray, box: CropBox, size: tuple[int, int]) -> np.ndarray:
    """The exact pixels the model saw: the image's crop box resized (bicubic) to the input size.

    Args:
        image: the original ``(H, W, 3)`` uint8 RGB image.
        box: its box from :func:`preprocess`.
        size: ``(h, w)`` of the model input.

    Returns:
        ``(h, w, 3)`` uint8 RGB.
    """
    region = crop_region(image, box)
    if tuple(region.shape[:2]) == tuple(size):
        return region
    return np.asarray(Image.fromarray(region).resize((int(size[1]), int(size[0])), Image.BICUBIC))


def paste_map(
    map: Any,  # noqa: A002 - mirrors overlay(image, map)
    box: CropBox,
    *,
    fill: float | None = None,
    interpolation: str = "bilinear",
) -> np.ndarray:
    """Place a map computed on a crop back onto the full original image.

    The map (any 2-D size, e.g. the ``(gh, gw)`` patch grid) is stretched over
    ``box`` with sub-pixel accuracy (pixel centres map onto pixel centres) and the
    pixels outside the box, which the model never saw, are set to ``fill``. The
    result can go straight into ``overlay(image, result)``.

    Args:
        map: 2-D array or tensor (any device), e.g. ``explanation.maps[i]``.
        box: The image's :class:`CropBox` from :func:`preprocess`.
        fill: Value outside the box. ``None`` uses the map's minimum, so ``minmax``
            overlays show the unseen border as "lowest" without changing contrast inside;
            pass ``0.0`` for signed maps so the border is neutral.
        interpolation: ``"nearest"``, ``"bilinear"`` or ``"bicubic"``.

    Returns:
        ``(H, W)`` float32 array for the original image size ``box.image_size``.
    """
    import cv2

    m = map_to_numpy(map)
    flags = {"nearest": cv2.INTER_NEAREST, "bilinear": cv2.INTER_LINEAR, "bicubic": cv2.INTER_CUBIC}
    if interpolation not in flags:
        raise UsageError(f"unknown interpolation {interpolation!r}; choose from {sorted(flags)}")
    h0, w0 = box.image_size
    mh, mw = m.shape
    sx, sy = box.width / mw, box.height / mh
    # map pixel centre (j + 0.5) -> image continuous x = left + (j + 0.5) * sx -> index x - 0.5
    mat = np.array([[sx, 0.0, box.left + 0.5 * sx - 0.5], [0.0, sy, box.top + 0.5 * sy - 0.5]])
    out = cv2.warpAffine(
        m, mat, (w0, h0), flags=flags[interpolation], borderMode=cv2.BORDER_REPLICATE
    )
    xs = np.arange(w0) + 0.5
    ys = np.arange(h0) + 0.5
    inside = ((ys >= box.top) & (ys < box.bottom))[:, None] & ((xs >= box.left) & (xs < box.right))[None]
    out[~inside] = float(m.min()) if fill is None else fill
    return out.astype(np.float32, copy=False)

