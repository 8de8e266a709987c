"""Exceptions raised by vitexplain.

Every error says what went wrong and what to do about it. All derive from
:class:`VitexplainError`, so ``except vx.VitexplainError`` catches any of them; each also
derives from the built-in exception it refines (``ValueError``, ``TypeError``, ``KeyError``,
``OSError``, ``RuntimeError``), so ``except ValueError`` keeps working.

Hierarchy::

    VitexplainError
      UsageError (ValueError)            how vitexplain was called: arguments, inputs, options
        OptionError (TypeError)          unknown method option, value out of its declared range
        InputError (TypeError)           wrong type/shape/content of an input
        NotFoundError (KeyError)         unknown zoo model, word, module name
        OutOfRangeError (IndexError)     an index past the end of a sequence (a ShapesBatch)
      UnsupportedModelError (TypeError)  the model family is not supported by an operation
      UnsupportedMethodError (ValueError) the method does not apply to this model
      TargetError (ValueError)           bad target (class index, label, score function)
      NoAttentionError (RuntimeError)    a forward ran but no attention call was seen
      CaptureError (RuntimeError)        a captured quantity cannot be provided
      ImageLoadError (OSError)           an image file cannot be read
      NumericalError (FloatingPointError) the model's outputs or a method's maps are not finite

    UnrecordedAttentionWarning (UserWarning)  attention a capture saw but could not record (its records are
                                              then not all of the model's attention)
    ConvergenceWarning (UserWarning)          a method's numerical integral missed what it must sum to
                                              (Integrated Gradients' completeness)
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
    "InputError",
    "NotFoundError",
    "NumericalError",
    "OutOfRangeError",
    "UnrecordedAttentionWarning",
    "ConvergenceWarning",
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


class InputError(UsageError, TypeError):
    """An argument of the wrong type, shape or content (e.g. a uint8 tensor where a
    preprocessed float batch is expected, NaN pixels, an empty batch)."""


class NotFoundError(UsageError, KeyError):
    """A name that does not exist (a zoo model, a vocabulary word, a module)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return BaseException.__str__(self)


class NumericalError(VitexplainError, FloatingPointError):
    """The model's outputs, a target score or a method's maps hold NaN or inf values, so no
    map would mean anything; the message names the images and what to check."""


class OutOfRangeError(UsageError, IndexError):
    """An index past the end of a sequence (e.g. ``ShapesBatch[i]``); an IndexError, so
    iterating by index stops at it."""


class UnrecordedAttentionWarning(UserWarning):
    """A capture saw attention it cannot record (a layout no record can hold, e.g. timm's HaloAttn): the records
    read are not all of the model's attention."""


class ConvergenceWarning(UserWarning):
    """Integrated Gradients' attributions of some image miss y(x) - y(baseline) by more than
    ``vitexplain.methods.captum_methods.COMPLETENESS_RTOL`` of it: the integral did not converge with the steps
    given or, by default (``steps=None``), with the most the method chooses (``captum_methods.AUTO_STEPS``' last);
    each image's ``completeness_error`` and ``steps`` are in the explanation's extras."""
