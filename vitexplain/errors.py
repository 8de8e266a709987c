"""Exceptions raised by vitexplain.

Every error says what went wrong and what to do about it. All derive from
:class:`VitexplainError`, so ``except vx.VitexplainError`` catches any of them.
"""

from __future__ import annotations

__all__ = [
    "VitexplainError",
    "NoAttentionError",
    "UnsupportedModelError",
    "UnsupportedMethodError",
    "TargetError",
    "CaptureError",
    "ImageLoadError",
    "UsageError",
    "OptionError",
]


class VitexplainError(Exception):
    """Base class of every error raised by vitexplain."""


class NoAttentionError(VitexplainError, RuntimeError):
    """A captured forward ran, but no attention call was seen."""


class UnsupportedModelError(VitexplainError, TypeError):
    """The model family is not supported by the requested operation."""


class UnsupportedMethodError(VitexplainError, ValueError):
    """The requested explanation method does not apply to this model."""


class TargetError(VitexplainError, ValueError):
    """A target (class index, label name, score function) is invalid."""


class CaptureError(VitexplainError, RuntimeError):
    """A captured quantity (probabilities, gradients) cannot be provided."""


class ImageLoadError(VitexplainError, OSError):
    """An image file cannot be read; the message names the file and the reason."""


class UsageError(VitexplainError, ValueError):
    """A problem with how vitexplain was called (arguments, inputs, options), found before
    any work is done; the command line prints the message and exits with status 2."""


class OptionError(UsageError, TypeError):
    """A method option is unknown or its value is out of the method's declared range."""
