"""An input size a model does not take, as an :class:`~vitexplain.errors.InputError` that says what to do.

timm, torchvision and Hugging Face ViTs built for one size refuse another with their own messages
(:data:`SIZE_REFUSAL`); a model whose adapter says it takes one size only (``fixed_size``, or ``one_size``
when that size is not known: a hybrid whose attention biases are built for one grid) may fail anywhere
inside on another; so may a CNN whose self-attention blocks take only some feature-map sizes (its adapter's
``size_refusal(x)`` says which sizes it takes). :func:`run_sized` turns those failures into one error, the model's message kept.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .adapters import Adapter, preprocessing
from .errors import InputError, VitexplainError
from .layout import patch_multiple_advice

__all__ = ["run_sized", "SIZE_REFUSAL"]

#: How timm ("Input height (64) doesn't match model (224)"), torchvision ("Wrong image height!")
#: and Hugging Face ("Input image size (64*64) doesn't match model") ViTs refuse an input size.
SIZE_REFUSAL = re.compile(r"(?i)doesn't match model|wrong image (height|width)|divisible by patch|input image size")


def _patch_multiple(err: Exception, adapter: Adapter, size: tuple[int, int]) -> Optional[tuple[int, int]]:
    """The (ph, pw) patch size when ``err`` is a model's refusal of an input its patch size does not
    divide (the model takes other sizes), else None."""
    if not re.search(r"(?i)divisible by patch", str(err)) or not hasattr(adapter, "layout"):
        return None
    try:
        patch = adapter.layout(size).patch_size
    except Exception:  # no layout for this size: the generic message
        return None
    return (int(patch[0]), int(patch[1])) if patch is not None else None


def run_sized(adapter: Adapter, x: Tensor, run: Callable[[], Any]) -> Any:
    """``run()``, a call of the model on ``x`` (B, C, H, W); a model's own refusal of the input size, or any
    failure of a model that takes one size only on another size, becomes an :class:`InputError` that says what
    to do (the model's message kept).

    Raises:
        InputError: the model does not take the size of ``x``.
    """
    try:
        return run()
    except (RuntimeError, ValueError, AssertionError, IndexError) as err:
        if isinstance(err, VitexplainError):
            raise
        size = tuple(x.shape[-2:])
        fixed = getattr(adapter, "fixed_size", None)
        one_size = getattr(adapter, "one_size", None)  # why it takes one size, which is not known
        refusal = getattr(adapter, "size_refusal", None)  # a CNN: which size it takes, found by probing
        oom = isinstance(err, torch.cuda.OutOfMemoryError)  # memory, not the size's shape: no probe forwards
        why = refusal(x) if callable(refusal) and fixed is None and one_size is None and not oom else None
        if why is not None:
            raise InputError(f"the model does not take a {size[0]}x{size[1]} input ({type(err).__name__}: {err}); {why}") from err
        if not SIZE_REFUSAL.search(str(err)) and (fixed is None or tuple(fixed) == size) and one_size is None:
            raise
        if fixed is None and one_size is not None:
            raise InputError(
                f"the model does not take a {size[0]}x{size[1]} input ({type(err).__name__}: {err}); {one_size}: "
                "resize the images to that size"
            ) from err
        patch = _patch_multiple(err, adapter, size)
        if patch is not None:  # a model that takes any size the patch divides (timm dynamic_img_size)
            raise InputError(
                f"the model does not take a {size[0]}x{size[1]} input ({type(err).__name__}: {err}); "
                f"{patch_multiple_advice(patch, size)}"
            ) from err
        expected = fixed or preprocessing(adapter).get("input_size")
        raise InputError(
            f"the model does not take a {size[0]}x{size[1]} input ({type(err).__name__}: {err}); it expects "
            f"{expected[0]}x{expected[1]} images: resize to that size, or pass images (paths or uint8 arrays) to "
            "have them preprocessed with the model's own settings"
        ) from err
