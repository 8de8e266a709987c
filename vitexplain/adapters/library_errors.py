"""An error that transformers' or torch's code raises while a model runs, as an :class:`UnsupportedModelError` that
says what went wrong and what to do (the model's message kept): one rule for the vision-language models' batches
(:meth:`~vitexplain.adapters.vlm.base.VLMAdapter.model_reads_batch`) and the captioners' generation and forwards
(:meth:`~vitexplain.adapters.captioning.CaptionAdapter.model_runs`)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from ..errors import UnsupportedModelError, VitexplainError

__all__ = ["library_errors", "raised_by_library"]


@contextmanager
def library_errors(explain: Callable[[BaseException], str], generating: bool = False) -> Iterator[None]:
    """Raise a ValueError, RuntimeError or IndexError of transformers' or torch's code in the block (with
    ``generating``, also a TypeError, AttributeError, KeyError or ImportError: ``generate`` reads settings of the
    model's ``generation_config`` whose type or cache the model's code cannot take) as an
    :class:`UnsupportedModelError` whose message is ``explain(err)``. Running out of memory, vitexplain's own errors
    and errors raised by other code (the user's own modules or hooks) come out as they are.

    Args:
        explain: the error -> the message (what could not run, the model's message, what to do).
        generating: the block runs ``generate``.

    Raises:
        UnsupportedModelError: such an error in the block.
    """
    caught: tuple[type[BaseException], ...] = (ValueError, RuntimeError, IndexError)
    if generating:
        caught += (TypeError, AttributeError, KeyError, ImportError)
    try:
        yield
    except (VitexplainError, torch.cuda.OutOfMemoryError):  # (torch.OutOfMemoryError in torch >= 2.5)
        raise
    except caught as err:
        if not raised_by_library(err):
            raise
        raise UnsupportedModelError(explain(err)) from err


def raised_by_library(err: BaseException) -> bool:
    """Whether the innermost Python frame of ``err``'s traceback is transformers' or torch's code, or the capture's
    (which makes the model's attention calls on its behalf): an error about what the model was given, not the
    user's (a module or hook of their own raising)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    filename = tb.tb_frame.f_code.co_filename
    return any(filename.startswith(root) for root in _library_roots())


def _library_roots() -> tuple[str, ...]:
    """The folders of the installed transformers and torch packages (transformers is imported by then) and of
    vitexplain's capture."""
    from .. import recording

    roots = [os.path.dirname(torch.__file__), os.path.dirname(recording.__file__)]
    transformers = sys.modules.get("transformers")
    if transformers is not None and getattr(transformers, "__file__", None):
        roots.append(os.path.dirname(transformers.__file__))
    return tuple(root + os.sep for root in roots)
