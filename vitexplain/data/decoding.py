"""Image decoding: any file Pillow can read -> ``(H, W, 3)`` uint8 RGB.

:func:`load_image` decodes any file Pillow can read into an ``(H, W, 3)`` uint8 **RGB**
array, with the same result for every input kind:

- EXIF orientation is applied (``ImageOps.exif_transpose``), so the array is what a
  photo viewer shows.
- Grayscale ``L`` / ``1`` are replicated to three channels.
- Integer gray data (Pillow's ``I;16*`` modes of 16-bit PNG/TIFF/PGM, and its 32-bit ``I``
  mode) is read by the range its values actually take, the same way for every mode (so a
  file gives the same pixels whichever mode a Pillow version opens it in):

  * all values in ``[0, 255]``: **8-bit data** in a wider container, taken as they are.
    This is what Pillow's own ``convert("I")`` / ``convert("I;16")`` of an 8-bit image and
    ``Image.fromarray`` of an 8-bit array cast to ``uint16`` / ``int32`` give; read as
    16-bit, every such image would be black (its high byte is 0).
  * all values in ``[0, 65535]``, some above 255: **16-bit data**, reduced with ``v >> 8``
    (the high byte), i.e. mapped from the full 16-bit range. This is the exact inverse of
    both common 8 -> 16 bit expansions (``v * 257`` and ``v << 8``) and matches what Pillow
    itself does for 16-bit *colour* PNGs (RGB48 keeps the high byte), so gray and colour
    16-bit files are scaled alike. 10- or 12-bit sensor data stored in 16 bits therefore
    looks dark, as in an image viewer.
  * any value below 0 or above 65535 (only in ``I``): min-max stretched to ``[0, 255]``.
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

Memory: the decoded image is converted to uint8 RGB strip by strip (:data:`STRIP_PIXELS`),
so decoding needs Pillow's decoded image, the result and one strip's temporaries (about
2.3-2.9x the result: Pillow keeps RGB and RGBA at 4 bytes a pixel).
"""

from __future__ import annotations

import inspect
import io
import math
import os
import warnings
from pathlib import Path
from typing import IO, Any, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import ImageLoadError, InputError

__all__ = ["ImageLoadError", "DEFAULT_MAX_PIXELS", "STRIP_PIXELS", "ImageSource", "load_image", "to_rgb"]

#: Default pixel limit: twice Pillow's ``MAX_IMAGE_PIXELS`` default (~179 megapixels),
#: the size at which Pillow itself refuses an image as a decompression bomb.
DEFAULT_MAX_PIXELS: int = 178_956_970

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

    See the module docstring for how each image mode is converted (integer gray data is
    read by the range of its values: all in 0..255 as 8-bit, up to 65535 as 16-bit keeping
    the high byte ``v >> 8``, anything wider min-max stretched; transparency is composited
    on white; EXIF orientation is applied). The input file is only ever opened for reading.

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
    if isinstance(source, (str, os.PathLike)) and not os.fspath(source):  # ("" is the working folder: "a directory")
        raise _fail("''", "the path is empty", "Pass the path of an image file.")
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
                rgb = to_rgb(_exif_transpose(im, name), name)
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
        lo, hi = _value_range(im, name)
        stretch = lo < 0 or hi > 65535
        shift = 0 if hi <= 255 else 8  # 8-bit values in a wider container: as they are; 16-bit: the high byte

        def integer(part: Image.Image) -> np.ndarray:
            raw = np.asarray(part)  # uint16 or int32: no wider copy than the strip
            out = _gray3(_stretch(raw, lo, hi) if stretch else (raw >> shift).astype(np.uint8))
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


def to_rgb(im: Image.Image, name: str = "<PIL image>") -> np.ndarray:
    """A decoded Pillow image as (H, W, 3) uint8 RGB, converted strip by strip: the only memory
    needed besides ``im`` and the result is one strip's temporaries (:data:`STRIP_PIXELS`)."""
    convert = _converter(im, name)
    w, h = im.size
    out = np.empty((h, w, 3), np.uint8)
    for top, part in _strips(im):
        rgb = convert(part)
        out[top : top + rgb.shape[0]] = rgb
    return out
