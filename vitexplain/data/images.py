"""Image loading and model preprocessing with crop bookkeeping.

:func:`load_image` decodes any file Pillow can read into an ``(H, W, 3)`` uint8 **RGB**
array, with the same result for every input kind:

- EXIF orientation is applied (``ImageOps.exif_transpose``), so the array is what a
  photo viewer shows.
- Grayscale ``L`` / ``1`` are replicated to three channels.
- 16-bit data (``I;16*`` PNG/TIFF, and Pillow's ``I`` mode when its values lie in
  ``[0, 65535]``) is reduced to 8 bit with ``v >> 8`` (the high byte). This is the exact
  inverse of both common 8 -> 16 bit expansions (``v * 257`` and ``v << 8``) and matches
  what Pillow itself does for 16-bit *colour* PNGs (RGB48 keeps the high byte), so gray
  and colour 16-bit files are scaled alike. ``I`` values outside ``[0, 65535]`` are
  min-max stretched to ``[0, 255]``.
- 32-bit float ``F`` images: values in ``[0, 1]`` are multiplied by 255, values in
  ``[0, 255]`` are taken as they are, anything else is min-max stretched. NaN/inf
  pixels are an error.
- Transparency (``RGBA``, ``LA``, ``PA``, palette or gray/RGB images with a ``tRNS``
  colour) is composited on **white**.
- Palette, CMYK (including Adobe-inverted CMYK JPEG), YCbCr and other modes are
  converted with Pillow. ICC profiles are not applied.
- Multi-frame files (GIF, TIFF) give their first frame.

Failures raise :class:`~vitexplain.errors.ImageLoadError` naming the file, the reason
and what to do: missing path, directory, empty file, unknown format, corrupt or
truncated data, and images above ``max_pixels`` (decompression bombs). Truncated files
are never half-decoded: pixels are forced with ``Image.load()`` and Pillow's
``ImageFile.LOAD_TRUNCATED_IMAGES`` is left as found (False by default) -- if other code
sets it to True, Pillow pads truncated images and this loader cannot tell.

:func:`preprocess` turns images into a normalised ``(B, 3, H, W)`` float32 tensor with
timm's evaluation transform (shorter side resized to ``int(size / crop_pct)``, center
crop) and returns, per image, the :class:`CropBox` the model saw, in original pixel
coordinates. :func:`crop_region` cuts that region out of the image so a map can be
overlaid on exactly what the model saw; :func:`paste_map` instead places a map back on
the full image.
"""

from __future__ import annotations

import inspect
import io
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Sequence, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import ImageLoadError, InputError, UsageError

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
    "check_resizable",
    "crop_region",
    "paste_map",
]

#: Default pixel limit: twice Pillow's ``MAX_IMAGE_PIXELS`` default (~179 megapixels),
#: the size at which Pillow itself refuses an image as a decompression bomb.
DEFAULT_MAX_PIXELS: int = 178_956_970

#: :func:`preprocess` (with ``crop=True``) refuses to resize an image to more pixels than
#: this many model inputs (at the resize scale, ``input_size / crop_pct``) or the image
#: itself, whichever is larger. A normal photo is only ever shrunk or mildly enlarged; a
#: 1 x 400,000 px strip would become a 73 x 29,200,000 px (8 GB) intermediate for a 64 px
#: model. This allows aspect ratios up to 64:1 for small images.
MAX_RESIZE_INPUTS: int = 64

#: What :func:`load_image` accepts: a path, raw encoded bytes, or a binary file object.
ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, IO[bytes]]

_ADVICE = "Check the file (re-download or re-export it) or leave it out of the input."


def _fail(name: str, reason: str, advice: str = _ADVICE) -> ImageLoadError:
    return ImageLoadError(f"cannot load image {name}: {reason}. {advice}")


def _source_name(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return str(os.fspath(source))
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{len(source)} bytes in memory>"
    name = getattr(source, "name", None)
    return str(name) if isinstance(name, (str, os.PathLike)) else f"<{type(source).__name__}>"


def _check_path(source: Any, name: str) -> Path:
    """Turn a path into an existing, non-empty regular file or raise ImageLoadError."""
    path = Path(os.fspath(source))
    try:
        st = path.stat()
    except FileNotFoundError:
        raise _fail(name, "no such file", "Check the path.") from None
    except PermissionError:
        raise _fail(name, "permission denied", "Check the file's permissions.") from None
    except OSError as e:
        raise _fail(name, f"cannot access the path ({e.strerror or e})") from None
    if path.is_dir():
        raise _fail(
            name,
            "it is a directory, not an image file",
            "Pass the image files inside it (the export CLI walks directories for you).",
        )
    if not path.is_file():
        raise _fail(name, "not a regular file", "Pass a regular image file.")
    if st.st_size == 0:
        raise _fail(name, "the file is empty (0 bytes)")
    return path


def load_image(source: ImageSource, *, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decode an image file into an ``(H, W, 3)`` uint8 RGB array.

    See the module docstring for how each image mode is converted (16-bit data keeps
    the high byte, ``v >> 8``; transparency is composited on white; EXIF orientation
    is applied). The input file is only ever opened for reading.

    Args:
        source: Path (``str`` or ``os.PathLike``), encoded bytes, or a binary file object
            (read from its current position; it is not closed).
        max_pixels: Refuse images with more than this many pixels (width x height),
            checked from the header before any pixel is decoded. ``None`` disables this
            check; Pillow's own limit (``PIL.Image.MAX_IMAGE_PIXELS``, an error at twice
            its value) still applies -- raise that too for larger images.

    Returns:
        ``(H, W, 3)`` uint8 array in RGB order (not BGR), C-contiguous and writable.

    Raises:
        ImageLoadError: The source is missing, a directory, empty, not an image, corrupt,
            truncated or too large. The message names the file and the reason.
        TypeError: ``source`` is none of the accepted kinds.
    """
    name = _source_name(source)
    if isinstance(source, (str, os.PathLike)):
        path = _check_path(source, name)
        try:
            with open(path, "rb") as f:  # read-only; closed on every path out
                return _decode(f, name, max_pixels)
        except ImageLoadError:
            raise
        except PermissionError:
            raise _fail(name, "permission denied", "Check the file's permissions.") from None
        except OSError as e:
            raise _fail(name, f"cannot read the file ({e.strerror or e})") from None
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise _fail(name, "no data (0 bytes)")
        return _decode(io.BytesIO(bytes(source)), name, max_pixels)
    if hasattr(source, "read"):
        seekable = getattr(source, "seekable", None)
        fp = source if callable(seekable) and seekable() else io.BytesIO(source.read())
        return _decode(fp, name, max_pixels)
    raise InputError(
        f"load_image expects a path (str or os.PathLike), bytes or a binary file object, "
        f"got {type(source).__name__}"
    )


def _decode(fp: IO[bytes], name: str, max_pixels: int | None) -> np.ndarray:
    try:
        with warnings.catch_warnings():
            # Our own max_pixels check below is the authority between Pillow's warning
            # threshold and its hard limit.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(fp) as im:
                width, height = im.size
                if max_pixels is not None and width * height > max_pixels:
                    raise _fail(
                        name,
                        f"{width}x{height} = {width * height:,} pixels exceeds max_pixels="
                        f"{max_pixels:,} (possible decompression bomb)",
                        "If the image is genuine, pass a larger max_pixels.",
                    )
                im.load()  # decode every pixel now: truncation and corruption surface here
                rgb = _to_rgb(_exif_transpose(im, name), name)
    except ImageLoadError:
        raise
    except Image.DecompressionBombError as e:
        raise _fail(
            name,
            f"Pillow refused it as a possible decompression bomb ({e})",
            "If the image is genuine, raise PIL.Image.MAX_IMAGE_PIXELS and max_pixels.",
        ) from None
    except UnidentifiedImageError:
        raise _fail(
            name, "not a recognised image format, or its header is corrupt (Pillow cannot identify it)"
        ) from None
    except MemoryError:
        raise
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, zlib.error, ...
        msg = str(e) or type(e).__name__
        if "truncated" in msg.lower() or isinstance(e, EOFError):
            reason = f"the file is truncated ({msg})"
        else:
            reason = f"corrupt or undecodable image data ({type(e).__name__}: {msg})"
        raise _fail(name, reason) from None
    return rgb


_IN_PLACE = {"in_place": True} if "in_place" in inspect.signature(ImageOps.exif_transpose).parameters else {}


def _exif_transpose(im: Image.Image, name: str) -> Image.Image:
    """``im`` turned upright by its EXIF orientation, in place (no second decoded image kept)."""
    try:
        out = ImageOps.exif_transpose(im, **_IN_PLACE)
    except Exception as e:  # malformed EXIF must not make a decodable image unreadable
        warnings.warn(
            f"{name}: could not apply the EXIF orientation ({e}); using the stored orientation",
            stacklevel=3,
        )
        return im
    return im if out is None else out


#: Pixels converted at a time: the conversion of a decoded image to uint8 RGB needs, besides
#: the decoded image and the result, only temporaries of one strip of this many pixels.
STRIP_PIXELS = 1 << 18

_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def _stretch(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """``values`` mapped linearly from ``[lo, hi]`` to uint8 ``[0, 255]``."""
    if hi <= lo:
        return np.zeros(values.shape, np.uint8)
    return np.rint((values.astype(np.float64) - lo) * (255.0 / (hi - lo))).astype(np.uint8)


def _composite_on_white(rgba: np.ndarray) -> np.ndarray:
    """(h, w, 4) uint8 -> (h, w, 3) uint8 composited on white."""
    a = rgba[..., 3:4].astype(np.uint16)  # rgb * a + 255 * (255 - a) + 127 <= 65152: uint16 holds it
    out = rgba[..., :3].astype(np.uint16)
    out *= a
    out += 255 * (255 - a) + 127
    out //= 255
    return out.astype(np.uint8)


def _gray3(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[..., None], 3, axis=2)


def _strips(im: Image.Image) -> Any:
    """``(top, part)``: ``im`` cut into strips of about :data:`STRIP_PIXELS` pixels (whole rows)."""
    w, h = im.size
    rows = max(1, STRIP_PIXELS // max(w, 1))
    if rows >= h:
        yield 0, im
        return
    for top in range(0, h, rows):
        yield top, im.crop((0, top, w, min(h, top + rows)))


def _value_range(im: Image.Image, name: str) -> tuple[float, float]:
    """Min and max of a one-band ``I``/``F`` image, strip by strip; NaN/inf is an error."""
    lo, hi = math.inf, -math.inf
    for _, part in _strips(im):
        raw = np.asarray(part)
        if not raw.size:
            continue
        if raw.dtype.kind == "f" and not np.isfinite(raw).all():
            raise _fail(name, "the float image contains NaN or infinite pixels")
        lo, hi = min(lo, float(raw.min())), max(hi, float(raw.max()))
    return (lo, hi) if lo <= hi else (0.0, 0.0)


def _converter(im: Image.Image, name: str) -> Any:
    """The function turning one strip of ``im`` into (rows, W, 3) uint8 RGB (see the module
    docstring for the rules of each mode)."""
    mode = im.mode
    trns = im.info.get("transparency")
    if mode.startswith("I;16") or mode == "I":
        lo, hi = _value_range(im, name) if mode == "I" else (0.0, 65535.0)
        stretch = lo < 0 or hi > 65535

        def integer(part: Image.Image) -> np.ndarray:
            raw = np.asarray(part)  # uint16 or int32: no wider copy than the strip
            out = _gray3(_stretch(raw, lo, hi) if stretch else (raw >> 8).astype(np.uint8))
            if isinstance(trns, int):
                out[raw == trns] = 255
            return out

        return integer
    if mode == "F":
        lo, hi = _value_range(im, name)
        if lo >= 0.0 and hi <= 1.0:
            return lambda part: _gray3(np.rint(np.asarray(part, dtype=np.float32) * 255.0).astype(np.uint8))
        if lo >= 0.0 and hi <= 255.0:
            return lambda part: _gray3(np.rint(np.asarray(part, dtype=np.float32)).astype(np.uint8))
        return lambda part: _gray3(_stretch(np.asarray(part, dtype=np.float32), lo, hi))
    if mode in _ALPHA_MODES or (trns is not None and mode in ("P", "L", "RGB", "1")):
        return lambda part: _composite_on_white(np.asarray(part if part.mode == "RGBA" else part.convert("RGBA")))
    if mode == "RGB":
        return np.asarray

    def other(part: Image.Image) -> np.ndarray:
        try:
            return np.asarray(part.convert("RGB"))
        except (ValueError, OSError) as e:
            raise _fail(name, f"unsupported image mode {mode!r} ({e})", "Convert it to RGB.") from None

    return other


def _to_rgb(im: Image.Image, name: str) -> np.ndarray:
    """A decoded image as (H, W, 3) uint8 RGB, converted strip by strip: the only memory
    needed besides ``im`` and the result is one strip's temporaries (:data:`STRIP_PIXELS`)."""
    convert = _converter(im, name)
    w, h = im.size
    out = np.empty((h, w, 3), np.uint8)
    for top, part in _strips(im):
        rgb = convert(part)
        out[top : top + rgb.shape[0]] = rgb
    return out


# --------------------------------------------------------------------------------------
# preprocessing


_R = getattr(Image, "Resampling", Image)  # Pillow < 9.1 has the constants on Image
_PIL_RESAMPLE = {
    "nearest": _R.NEAREST,
    "bilinear": _R.BILINEAR,
    "bicubic": _R.BICUBIC,
    "lanczos": _R.LANCZOS,
    "box": _R.BOX,
    "hamming": _R.HAMMING,
}


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
        return image if image.mode == "RGB" else Image.fromarray(_to_rgb(image, "<PIL image>"), "RGB")
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
        tensors.append(x.sub_(mean_t).div_(std_t))
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

    cfg = resolve_data_config(model=model)
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

    from ..viz._util import map_to_numpy

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

