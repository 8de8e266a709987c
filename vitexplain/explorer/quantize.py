"""Row-wise uint8 quantisation of the arrays an explorer page embeds.

Each row (the last axis) is stored as uint8 codes with one float32 scale per row:

- non-negative rows: ``code = round(255 * v / s)`` with ``s = max(v)``, so the largest value of
  a row is code 255 and ``v ~= code * s / 255`` (error at most ``s / 510``);
- signed rows: ``code = 128 + round(127 * v / s)`` with ``s = max|v|``, so zero is code 128
  exactly and ``v ~= (code - 128) * s / 127``.

An all-zero row has scale 0 (and decodes to zeros). Codes and scales travel as base64
(little-endian float32), decoded by the page's script (``static/common.js``, ``decodeQ``).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from ..errors import UsageError

__all__ = ["quantize_rows", "dequantize_rows", "payload_bytes"]


def _array(values: Any) -> np.ndarray:
    if hasattr(values, "detach") and hasattr(values, "cpu"):
        values = values.detach().cpu().float().numpy()
    array = np.asarray(values, dtype=np.float64)
    if array.ndim < 1 or array.size == 0:
        raise UsageError(f"expected a non-empty array with rows, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise UsageError(
            "cannot embed NaN/inf values in the explorer page: the method that produced them failed "
            "numerically; check the model outputs and gradients"
        )
    return array.reshape(-1, array.shape[-1])


def quantize_rows(values: Any, signed: bool = False) -> dict[str, Any]:
    """Quantise an array row by row (rows: every axis but the last).

    Args:
        values: (..., C) numbers (numpy or torch); rows are the flattened leading axes.
        signed: store signed codes (zero exact); also chosen when a row holds a negative value.

    Returns:
        ``{"rows": R, "cols": C, "signed": bool, "scale": base64 float32 (R,), "data": base64
        uint8 (R * C,)}``.

    Raises:
        UsageError: an empty array or NaN/inf values.
    """
    rows = _array(values)
    signed = bool(signed or (rows < 0).any())
    if signed:
        scale = np.abs(rows).max(axis=1)
        safe = np.where(scale > 0, scale, 1.0)[:, None]
        codes = 128 + np.rint(127 * rows / safe)
    else:
        scale = rows.max(axis=1)
        safe = np.where(scale > 0, scale, 1.0)[:, None]
        codes = np.rint(255 * rows / safe)
    return {
        "rows": int(rows.shape[0]),
        "cols": int(rows.shape[1]),
        "signed": signed,
        "scale": base64.b64encode(scale.astype("<f4").tobytes()).decode("ascii"),
        "data": base64.b64encode(np.clip(codes, 0, 255).astype(np.uint8).tobytes()).decode("ascii"),
    }


def dequantize_rows(q: dict[str, Any]) -> np.ndarray:
    """The (R, C) float32 values of :func:`quantize_rows`'s output (what the page decodes)."""
    scale = np.frombuffer(base64.b64decode(q["scale"]), dtype="<f4").astype(np.float32)
    codes = np.frombuffer(base64.b64decode(q["data"]), dtype=np.uint8).astype(np.float32)
    codes = codes.reshape(q["rows"], q["cols"])
    if q["signed"]:
        return (codes - 128) * (scale[:, None] / 127)
    return codes * (scale[:, None] / 255)


def payload_bytes(rows: int, cols: int) -> int:
    """Base64 characters :func:`quantize_rows` embeds for a (rows, cols) array."""
    return 4 * ((rows * cols + 2) // 3) + 4 * ((rows * 4 + 2) // 3)
