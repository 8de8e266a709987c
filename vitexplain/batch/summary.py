"""``summary.json``: counts, timings, failures, environment -- and the run's outcome.

``status`` is ``"ok"`` (every image done or current), ``"failed"`` (some images or folders
failed; exit 1), ``"interrupted"`` (Ctrl-C or SIGTERM; exit 130 / 143) or
``"output_error"`` (the output folder could not be written, e.g. a full disk; exit 74, with
the message in ``error``). Interrupted and stopped runs write it too, so it always says what
was done.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .run import Run

__all__ = ["run_counts", "build_summary", "versions"]


def run_counts(run: "Run", all_stats: list[dict[str, Any]]) -> dict[str, int]:
    """``{"images", "ok", "failed", "skipped"}`` over every rank, plus ``unreadable_folders``
    when some input folders could not be listed."""
    counts = {
        "images": len(run.items),
        "ok": sum(s["ok"] for s in all_stats),
        "failed": sum(s["failed"] for s in all_stats),
        "skipped": sum(s["skipped"] for s in all_stats),
    }
    if run.unreadable:
        counts["unreadable_folders"] = len(run.unreadable)
    return counts


def build_summary(
    run: "Run", all_stats: list[dict[str, Any]], t_start: float, *, status: str, error: str | None,
    fields: dict[str, Any], records: int | None,
) -> dict[str, Any]:
    """The content of ``summary.json``.

    Args:
        run: the run.
        all_stats: per-rank statistics from the driver.
        t_start: ``time.perf_counter()`` at the start of the command.
        status: the outcome (see the module docstring).
        error: the message that ended the run, or None.
        fields: the command's entries (``model``, ``methods``, ..., ``arguments``, ``argv``,
            ``config``), placed after the counts and failures.
        records: lines in the merged ``manifest.jsonl`` (None when it could not be written).
    """
    process_s = max(s["process_s"] for s in all_stats)
    counts = run_counts(run, all_stats)
    processed = counts["ok"] + counts["failed"]
    failures = [f for s in all_stats for f in s["failures"]]
    failures = [{"input": u.path, "error": f"cannot read this folder: {u.error}"} for u in run.unreadable] + failures
    return {
        "status": status,
        "error": error,
        "counts": counts,
        "timings": {
            "total_s": round(time.perf_counter() - t_start, 4),
            "setup_s": round(max(s["setup_s"] for s in all_stats), 4),
            "process_s": round(process_s, 4),
            "load_wait_s": round(sum(s["load_wait_s"] for s in all_stats), 4),
            "explain_s": round(sum(s["explain_s"] for s in all_stats), 4),
            "write_s": round(sum(s["write_s"] for s in all_stats), 4),
            "images_per_s": round(processed / process_s, 3) if process_s > 0 else None,
        },
        "failures": failures,
        "damaged_outputs": [d for s in all_stats for d in s.get("damaged", [])],
        "unverified_outputs": sum(s.get("unverified", 0) for s in all_stats),
        **fields,
        "device": str(run.device) if run.dist.world == 1 else f"{run.device.type} x {run.dist.world}",
        "world_size": run.dist.world,
        "versions": versions(),
        "config_hash": run.config_hash,
        "manifest_records": records,
        "cleaned_temp_files": run.cleaned_temps,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def versions() -> dict[str, str]:
    """Versions of vitexplain, torch, numpy, Python, timm, OpenCV and Pillow."""
    import numpy
    import torch

    from .. import __version__

    out = {"vitexplain": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
           "python": sys.version.split()[0]}
    for name, label in (("timm", "timm"), ("cv2", "opencv"), ("PIL", "pillow")):
        try:
            out[label] = str(__import__(name).__version__)
        except Exception:  # pragma: no cover
            pass
    return out
