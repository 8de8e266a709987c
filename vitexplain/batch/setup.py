"""What every batch command does before its model runs: check options, output folder and
inputs, pick the device, plan the methods (the Explainer's plan), and digest the settings.

Everything here raises :class:`~vitexplain.errors.UsageError` (exit status 2) and runs before
any output is written -- the output folder is checked writable but not created.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ..errors import UsageError
from .distributed import Dist, device_and_amp
from .run import Run, say
from .inputs import InputScan, scan_inputs
from .options import output_settings, validate
from .lock import LOCK_NAME
from .manifest import GALLERY, MANIFEST, SUMMARY
from .outfolder import check_own_names, check_writable

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Setup", "with_threads", "prepare", "plan_run", "one_by_one_on_image_errors", "probe", "config_hash", "new_run",
           "summary_fields"]


@dataclass
class Setup:
    """The checked basics of a run.

    Attributes:
        dist: the distributed setting.
        device: where the model runs.
        autocast_dtype: CUDA autocast dtype, or None.
        out: the output folder (not created yet).
        scan: the inputs found.
    """

    dist: Dist
    device: "torch.device"
    autocast_dtype: Any
    out: Path
    scan: InputScan


def with_threads(command: Callable[..., Any]) -> Callable[..., Any]:
    """A batch command ``command(opts, ...)`` run with torch's intra-op threads set to
    ``opts.threads`` (None: as they are) and restored afterwards
    (:func:`vitexplain.threads.using`); the options are validated first."""
    from ..threads import using

    @functools.wraps(command)
    def run(opts: Any, *args: Any, **kwargs: Any) -> Any:
        validate(opts)
        _check_threads(getattr(opts, "threads", None), "--threads", "torch threads")
        _check_threads(getattr(opts, "write_threads", None), "--write-threads", "writer threads")
        with using(getattr(opts, "threads", None)):
            return command(opts, *args, **kwargs)

    return run


def prepare(opts: Any) -> Setup:
    """Validate the options, the output folder and the inputs; pick the device.

    Raises:
        UsageError: a bad option value or colormap, an output folder that cannot be
            written (read-only, a dangling symlink, a file, a folder where the run writes its
            manifest, summary, gallery or lock), inputs that match nothing or
            lie inside the output folder, an unusable device.
    """
    validate(opts)
    _check_workers(opts.workers)
    _check_colormaps(opts.colormap, opts.signed_colormap)
    dist = Dist.from_env()
    device, autocast_dtype = device_and_amp(opts.device, opts.amp, dist)
    check_writable(opts.out)
    check_own_names(opts.out, [MANIFEST, SUMMARY, LOCK_NAME] + ([GALLERY] if opts.html else []))
    scan = scan_inputs(opts.inputs, opts.out)
    if dist.rank == 0:
        for folder in scan.earlier_outputs:
            say(f"vitexplain: skipping {folder}: the output folder of an earlier run (it holds that run's "
                "summary.json); name it as an input to explain its files")
    return Setup(dist=dist, device=device, autocast_dtype=autocast_dtype, out=Path(opts.out), scan=scan)


def max_workers() -> int:
    """The most DataLoader workers a run may start: ``max(64, 8 x CPUs)`` (decoding is I/O-bound
    at most a few times over; past that each worker is a forked copy of the process doing nothing)."""
    return max(64, 8 * (os.cpu_count() or 1))


def _check_workers(workers: int) -> None:
    limit = max_workers()
    if workers > limit:
        raise UsageError(f"--workers {workers}: more decoding processes than this machine ({os.cpu_count()} CPUs) "
                         f"can use; each is a copy of the process. Use at most {limit} (about the number of CPUs "
                         "is usually best)")


def _check_threads(count: Optional[int], flag: str, what: str) -> None:
    """A thread count far past the machine is a usage error (``--threads 100000``: OpenMP's pool
    exhausted the memory, and the next library to load failed with a misleading message)."""
    limit = max_workers()
    if count is not None and count > limit:
        raise UsageError(f"{flag} {count}: more {what} than this machine ({os.cpu_count()} CPUs) can use. "
                         f"Use at most {limit} (about the number of CPUs is usually best)")


def _check_colormaps(*colormaps: str) -> None:
    from ..viz.colormaps import colormap_lut

    for cmap in colormaps:
        try:
            colormap_lut(cmap)
        except ValueError as e:
            raise UsageError(f"colormap {cmap!r}: {e}") from None


def plan_run(explainer: Any, requested: Optional[Sequence[str]], options: dict[str, dict[str, Any]], *,
             command: str, model: str) -> Any:
    """The plan of a batch run (:meth:`vitexplain.Explainer.plan`): the requested methods, or the
    family's defaults that apply; every problem is a usage error (exit 2) found before any work.

    Args:
        explainer: the model's Explainer.
        requested: ``--method`` names (None: the defaults).
        options: ``--option`` values, ``{method: {option: value}}``.
        command: ``"export"`` or ``"caption"``: the family's entry point must be this command's
            (``explain`` or ``explain_caption``).
        model: ``--model`` as given (for messages).

    Raises:
        UsageError: the model is not explained by this command, a method does not apply,
            bad options.
    """
    from ..errors import VitexplainError

    entry = {"export": "explain", "caption": "explain_caption"}[command]
    family = explainer.family
    if family.entry != entry:
        other = {"explain": "export", "explain_caption": "caption"}[family.entry]
        raise UsageError(
            f"--model {model!r} is a {family.name} model ({family.summary}); `vitexplain {command}` does not explain "
            f"it: run `vitexplain {other} INPUT... --out DIR --model {model}`"
        )
    try:
        return explainer.plan(list(dict.fromkeys(requested)) if requested else None, **(options or {}))
    except VitexplainError as e:
        if isinstance(e, UsageError):
            raise
        raise UsageError(str(e)) from None


def one_by_one_on_image_errors(process: Callable[..., Any]) -> Callable[..., Any]:
    """``process(x, good)`` that, when a batch fails for what may be one image's doing, explains its images one by
    one, so only the images that fail are failed (each with its own error): outputs or maps not finite
    (:class:`~vitexplain.errors.NumericalError`), a method that refuses an image
    (:class:`~vitexplain.errors.UnsupportedMethodError` at explain time, e.g. integrated gradients whose path is
    flat for that image; the run's probe has refused methods that fail on every image), or memory (one image at a
    time may fit where the batch did not)."""
    import torch

    from ..errors import NumericalError, UnsupportedMethodError

    alone = (NumericalError, UnsupportedMethodError, torch.OutOfMemoryError, MemoryError)

    def run(x: "torch.Tensor", good: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Any]]:
        try:
            return process(x, good)
        except alone:
            if len(good) == 1:
                raise
        jobs: list[tuple[dict[str, Any], Any]] = []
        for i, sample in enumerate(good):
            try:
                jobs.extend(process(x[i : i + 1], [sample]))
            except alone as e:
                jobs.append(({}, f"{sample['key']}: {type(e).__name__}: {e}"))
        return jobs

    return run


def probe(explain: Callable[["torch.Tensor"], Any], what: str, setup: Setup, pre_kwargs: dict[str, Any]) -> Any:
    """Explain one blank image before writing anything, so that a method that cannot work on
    the model (no attention found, no gates, a caption with unknown words) is a usage error
    (exit 2) instead of the same failure repeated for every image.

    Args:
        explain: ``explain(x)`` for a (1, 3, H, W) batch.
        what: what is explained, for the message (``"this model with rollout, cdam"``).
        setup: the run's device and autocast.
        pre_kwargs: the model's preprocessing arguments (``input_size``).

    Returns:
        What ``explain`` returned.

    Raises:
        UsageError: ``explain`` failed.
    """
    import torch

    from .distributed import autocast

    h, w = pre_kwargs["input_size"]
    x = torch.zeros(1, 3, int(h), int(w), device=setup.device)
    try:
        with autocast(setup.autocast_dtype):
            return explain(x)
    except Exception as e:
        raise UsageError(f"cannot explain {what} (tried on a blank {h}x{w} image): {type(e).__name__}: {e}") from None


def config_hash(opts: Any, resolved: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The settings that change the outputs and their digest (the resume rule).

    Args:
        opts: the command's options: every field declared with ``outputs=True`` is included.
        resolved: values replacing or adding to those (e.g. the methods actually run, the
            model's absolute path, the checkpoint's size and mtime, the command).

    Returns:
        ``(config, digest)``.
    """
    config = {**output_settings(opts), **resolved}
    text = json.dumps(config, sort_keys=True, default=str)
    return config, hashlib.sha1(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def new_run(command: str, opts: Any, setup: Setup, pre_kwargs: dict[str, Any], digest: str, *, max_side: int) -> Run:
    """The driver's :class:`~vitexplain.batch.driver.Run` of a command from its options and setup."""
    return Run(
        command=command, out=setup.out, items=setup.scan.items, unreadable=setup.scan.unreadable,
        dist=setup.dist, device=setup.device, autocast_dtype=setup.autocast_dtype, pre_kwargs=pre_kwargs,
        config_hash=digest, crop=opts.crop, max_side=max_side, batch_size=opts.batch_size, workers=opts.workers,
        write_threads=opts.write_threads, overwrite=opts.overwrite, quiet=opts.quiet,
    )


def summary_fields(opts: Any, argv: Optional[Sequence[str]], config: dict[str, Any], **entries: Any) -> dict[str, Any]:
    """A command's entries of ``summary.json``: ``entries`` (model, methods, ...), then
    ``arguments``, ``argv`` and ``config``."""
    return {**entries, "arguments": asdict(opts), "argv": list(argv) if argv is not None else None, "config": config}
