"""The types of a batch run, shared by the driver, its loop and the commands: what a run is
(:class:`Run`), what a command adds (:class:`Command`, :data:`ProcessFn`), what it returns
(:class:`ExportResult`) and its exit codes.

Exit codes (:attr:`ExportResult.exit_code`, the CLI's status): 0 every image done or current;
1 some images (or input folders) failed, the others were done; 2 a usage error
(:class:`~vitexplain.errors.UsageError`); 74 the output folder could not be written (a full
disk, an I/O error): the run stopped, what was finished is recorded and a rerun resumes;
130 Ctrl-C and 143 SIGTERM (:mod:`~vitexplain.batch.signals`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..errors import VitexplainError
from .distributed import Dist
from .inputs import InputItem, Unreadable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..files import WriteFn

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_OUTPUT", "EXIT_INTERRUPTED", "EXIT_TERMINATED",
           "ExportResult", "Run", "Command", "ProcessFn", "RankFailedError", "say"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_OUTPUT = 74  # EX_IOERR of sysexits.h
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM


@dataclass
class ExportResult:
    """What a batch command returns.

    Attributes:
        exit_code: 0 all good, 1 some images failed, 74 the output folder could not be
            written (the CLI's exit status).
        summary: the content of ``summary.json`` (on rank 0; other ranks get their own counts).
        out: the output folder.
    """

    exit_code: int
    summary: dict[str, Any]
    out: Path


@dataclass
class Run:
    """What the driver needs to know, whatever the command.

    Attributes:
        command: ``"export"`` or ``"caption"`` (progress bar and messages).
        out: output folder.
        items: every input of the run (all ranks), sorted by key.
        unreadable: input folders that could not be listed.
        dist: the distributed setting.
        device: where the model runs.
        autocast_dtype: CUDA autocast dtype, or None.
        pre_kwargs: the model's :func:`vitexplain.data.images.preprocess` arguments.
        config_hash: digest of every setting that changes the outputs (the resume rule).
        crop, max_side, batch_size, workers, write_threads, overwrite, quiet: as the options.
        cleaned_temps: temporary files of killed runs removed at the start (rank 0).
    """

    command: str
    out: Path
    items: list[InputItem]
    unreadable: list[Unreadable]
    dist: Dist
    device: "torch.device"
    autocast_dtype: Any
    pre_kwargs: dict[str, Any]
    config_hash: str
    crop: bool
    max_side: int
    batch_size: int
    workers: int
    write_threads: int
    overwrite: bool
    quiet: bool
    cleaned_temps: int = 0


#: ``process(x, good)``: explain one decoded batch ``x`` (B, 3, H, W) (on the device, inside
#: autocast) whose samples are ``good`` (dicts with ``key``, ``region`` (h, w, 3) uint8 RGB,
#: ``width``, ``height``, ``box``); returns per sample the manifest fields to add and the
#: write job of its files, or an error message (that image fails). An exception fails the
#: batch's images (reported, the run goes on).
ProcessFn = Callable[["torch.Tensor", list[dict[str, Any]]], list[tuple[dict[str, Any], "WriteFn | str"]]]


@dataclass
class Command:
    """What a command adds to the driver.

    Attributes:
        process: explains a batch (:data:`ProcessFn`).
        fields: the command's entries of ``summary.json`` (model, methods, arguments, config...).
        gallery: writes ``index.html`` from the merged manifest records, or None.
    """

    process: ProcessFn
    fields: dict[str, Any]
    gallery: Optional[Callable[[list[dict[str, Any]]], None]] = None


class RankFailedError(VitexplainError, RuntimeError):
    """Another process of a distributed run (``torchrun``) failed; the message says which and why."""


def say(msg: str, bar: Any = None) -> None:
    """Print a message to stderr (above the progress bar when there is one)."""
    if bar is not None:
        bar.write(msg, file=sys.stderr)
    else:
        print(msg, file=sys.stderr, flush=True)
