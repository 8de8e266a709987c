"""The shared driver of the batch commands: lock, shard, resume, decode, explain, write, summarise.

A command (``export``, ``caption``) supplies a :class:`Command`: how a batch is explained
(:data:`ProcessFn`, which returns one write job per image, :data:`~vitexplain.files.WriteFn`),
its entries of ``summary.json`` and its gallery. The driver does the rest:

1. rank 0 creates ``--out``, takes its lock (:mod:`~vitexplain.batch.lock`; a folder in use
   by another live run is a usage error) and removes temporary files left by killed runs;
2. each rank takes its shard, skips images whose outputs are current (the resume rule: the same
   input and settings, :func:`_same_work`, and every output file as written,
   :func:`~vitexplain.batch.integrity.damage`: checked by its recorded size and mtime, or its digest
   when the mtime differs);
   damaged ones are redone and named on stderr and in the summary; those of an older version's
   records, without checksums, only checked to exist and counted as ``unverified_outputs``),
   decodes the rest in a DataLoader and explains them batch by batch
   while a thread pool draws and writes the files of the previous batches;
3. every finished image's record is appended to this run's manifest part, whole;
4. when every rank is done, rank 0 merges the manifest, writes ``summary.json`` (and a
   gallery) and releases the lock.

The run's types and exit codes are in :mod:`~vitexplain.batch.run` (re-exported here); a
usage error (exit 2) raises :class:`~vitexplain.errors.UsageError`; Ctrl-C (130) and SIGTERM
(143) raise :class:`KeyboardInterrupt` (:class:`Interrupted` for SIGTERM) after the summary is
written (:mod:`~vitexplain.batch.signals`).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Optional

from ..errors import UsageError
from .inputs import InputItem, Unreadable
from .integrity import damage, has_checksums, stat_horizon
from .lock import OutputLock
from .manifest import PART_RE, SUMMARY, ManifestPart, merge_manifest, new_run_id, read_manifest
from .run import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_OUTPUT, EXIT_TERMINATED, EXIT_USAGE,  # noqa: F401
                  Command, ExportResult, ProcessFn, RankFailedError, Run, say)
from .shard import new_stats, run_shard
from .signals import Interrupted, StopSignals, interrupt_for, signals_as_interrupts  # noqa: F401 - re-exported
from .summary import build_summary, run_counts
from .outfolder import clean_stale_temps
from ..files import OutputError, Writer, json_bytes, json_safe

# the run's types and the signal helpers are re-exported for code that imported them from here
__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_OUTPUT", "EXIT_INTERRUPTED", "EXIT_TERMINATED",
           "ExportResult", "Interrupted", "Run", "Command", "ProcessFn", "drive", "signals_as_interrupts",
           "source_of", "say"]


def source_of(path: str) -> dict[str, Any]:
    """``{"path": absolute path, "bytes", "mtime_ns"}`` of an input (None sizes if it cannot be
    stat'ed), plus ``"path_bytes_hex"``, the exact bytes of the absolute path, when they are not
    UTF-8 (JSON shows them as ``\\xNN`` text; the gallery links the real file with these)."""
    full = os.path.abspath(path)
    try:
        st = os.stat(path)
        source: dict[str, Any] = {"path": full, "bytes": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}
    except OSError:
        source = {"path": full, "bytes": None, "mtime_ns": None}
    if not full.isascii():
        try:
            full.encode("utf-8")
        except UnicodeEncodeError:
            source["path_bytes_hex"] = os.fsencode(full).hex()
    return source


def _same_work(rec: Optional[dict[str, Any]], source: dict[str, Any], config_hash: str) -> bool:
    """An ok record with output files, for the same file (path, size, mtime) and the same settings."""
    if not rec or rec.get("status") != "ok" or rec.get("config_hash") != config_hash:
        return False
    if rec.get("source") != (source if source["path"].isascii() else json_safe(source)):
        return False
    return bool(rec.get("files"))


#: Damaged outputs named one by one on stderr per rank; the rest are counted (all are in the summary).
_DAMAGE_LINES = 20


def _warn_damaged(damaged: list[dict[str, str]]) -> None:
    for d in damaged[:_DAMAGE_LINES]:
        say(f"vitexplain: warning: {d['file']} of {d['input']}: {d['reason']}; redoing this image")
    if len(damaged) > _DAMAGE_LINES:
        say(f"vitexplain: warning: and {len(damaged) - _DAMAGE_LINES} more images whose outputs cannot be "
            "trusted are redone (summary.json lists them under damaged_outputs)")


def _start(run: Run, lock: OutputLock) -> str:
    """Rank 0: create ``--out``, take ``lock``, clean stale temporary files; every rank gets the
    run id (or the same usage error)."""
    status: dict[str, Any] = {}
    if run.dist.rank == 0:
        try:
            run.out.mkdir(parents=True, exist_ok=True)
            lock.acquire()
            killed = any(PART_RE.match(name) for name in os.listdir(run.out))  # unmerged parts
            run.cleaned_temps = clean_stale_temps(run.out, everywhere=killed)
            status = {"run_id": new_run_id()}
        except UsageError as e:
            status = {"usage": str(e)}
        except OSError as e:
            status = {"usage": f"--out {str(run.out)!r} cannot be used: {e.strerror or e}"}
    first = run.dist.gather(status)[0]
    if "usage" in first:
        raise UsageError(first["usage"])
    return first["run_id"]


def drive(run: Run, command: Command, t_start: float) -> ExportResult:
    """Run a command over its inputs (see the module docstring).

    Returns:
        :class:`ExportResult` (exit code 0, 1 or 74).

    Raises:
        UsageError: the output folder is in use by another run, or cannot be created.
        KeyboardInterrupt: after Ctrl-C or SIGTERM (:class:`Interrupted`), once finished
            files are recorded and the summary is written (a signal while the run finishes
            is held until then, :mod:`~vitexplain.batch.signals`).
    """
    dist, out = run.dist, run.out
    dist.init(run.device)
    lock = OutputLock(out, f"vitexplain {run.command}")
    signals = StopSignals()
    with signals:
        try:
            run_id = _start(run, lock)
            if dist.rank == 0:
                for u in run.unreadable:
                    say(f"vitexplain: warning: cannot read folder {u.path} ({u.error}); its images are not exported")
            shard = run.items[dist.rank :: dist.world]
            previous = {} if run.overwrite else read_manifest(out)
            todo: list[tuple[InputItem, dict[str, Any]]] = []
            skipped = 0
            damaged: list[dict[str, str]] = []  # current records whose files are not as written: redone
            unverified = 0  # skipped images of an older version's records (no checksums): only present
            refreshed: list[dict[str, Any]] = []  # current records whose files' mtimes changed, content not
            horizon = stat_horizon(out)
            for item in shard:
                source = source_of(item.path)
                rec = previous.get(item.key)
                if not run.overwrite and _same_work(rec, source, run.config_hash):
                    fresh: dict[str, dict[str, Any]] = {}
                    why = damage(rec or {}, out, horizon, fresh)
                    if why is None:
                        skipped += 1
                        unverified += not has_checksums(rec or {})
                        if fresh and rec is not None:  # read once: the next resume trusts them by stat
                            refreshed.append({**rec, "checksums": {**rec["checksums"], **fresh}})
                        continue
                    damaged.append({"input": item.path, "file": why[0], "reason": why[1]})
                todo.append((item, source))
            _warn_damaged(damaged)
            setup_s = time.perf_counter() - t_start
            crash: Optional[BaseException] = None
            part: Optional[ManifestPart] = None
            stats = new_stats(skipped)
            stats["damaged"] = damaged[:1000]
            stats["unverified"] = unverified
            try:
                part = ManifestPart(out, run_id, dist.rank)
                for fixed in refreshed:  # (same time as before: read after manifest.jsonl, the part's copy wins)
                    part.append(fixed)
                if dist.rank == 0:
                    _record_unreadable(run, part)
                run_shard(todo, run=run, process=command.process, stats=stats, part=part, signals=signals)
            except OutputError as e:  # the manifest part cannot be created or written
                stats["output_error"] = str(e)
            except KeyboardInterrupt as e:  # a signal outside the loop's own handling
                stats["interrupted"] = getattr(e, "signum", signal.SIGINT)
            except Exception as e:  # tell the other ranks instead of leaving them at the barrier
                if dist.world == 1:
                    raise
                crash = e
                stats = {"crashed": f"rank {dist.rank}: {type(e).__name__}: {e}"}
            finally:
                signals.defer()  # finishing: signals are held until the summary is written
                if part is not None:
                    part.close()
            stats["setup_s"] = setup_s
            all_stats = dist.gather(stats)  # also the barrier: every rank has closed its part
            crashed = [s["crashed"] for s in all_stats if "crashed" in s]
            if crashed:
                if crash is not None:
                    raise crash
                raise RankFailedError(f"{run.command} failed on another rank: " + "; ".join(crashed))
            summary: dict[str, Any] = {"rank": dist.rank, **stats}
            try:
                if dist.rank == 0:
                    summary = _finish(run, command, all_stats, t_start, signals)
            finally:
                # Nobody exits before rank 0 has merged: launchers such as torchrun stop every
                # rank as soon as one exits non-zero (exit 1 = some images failed).
                dist.barrier()
        finally:
            signals.defer()
            lock.release()
            dist.close()
    interrupted = [s["interrupted"] for s in all_stats if s.get("interrupted")]
    signum = signals.first or (max(interrupted) if interrupted else None)
    if signum:
        raise interrupt_for(signum)
    if any(s.get("output_error") for s in all_stats):
        code = EXIT_OUTPUT
    else:
        code = EXIT_FAILED if sum(s["failed"] for s in all_stats) or run.unreadable else EXIT_OK
    return ExportResult(exit_code=code, summary=summary, out=out)


def _record_unreadable(run: Run, part: ManifestPart) -> None:
    for u in run.unreadable:
        part.append({"key": _folder_key(u), "input": u.path, "status": "failed", "kind": "folder",
                     "error": f"cannot read folder {u.path}: {u.error}", "files": {}, "time": time.time(),
                     "config_hash": run.config_hash, "rank": run.dist.rank})


def _folder_key(u: Unreadable) -> str:
    return u.path.rstrip("/\\") + "/"


def _finish(run: Run, command: Command, all_stats: list[dict[str, Any]], t_start: float,
            signals: StopSignals) -> dict[str, Any]:
    """Rank 0: merge the manifest, write the gallery and ``summary.json`` (last); report the outcome.

    Signals are held meanwhile (``signals``); one received before the summary is built makes
    its status ``interrupted``. Each step is atomic and a rerun redoes what is missing: the
    parts are removed only after ``manifest.jsonl`` is in place, and a rerun whose images are
    all current still merges, draws the gallery and writes the summary.
    """
    errors = [s["output_error"] for s in all_stats if s.get("output_error")]
    error = errors[0] if errors else None
    records: Optional[list[dict[str, Any]]] = None
    keys = {it.key for it in run.items} | {_folder_key(u) for u in run.unreadable}
    try:
        records = merge_manifest(run.out, keys)
        if command.gallery is not None and not errors:
            command.gallery(records)
    except OSError as e:  # OutputError, or a name taken meanwhile (a folder named manifest.jsonl)
        error = error or str(e)
    counts = run_counts(run, all_stats)
    unverified = sum(s.get("unverified", 0) for s in all_stats)
    if unverified:
        say(f"vitexplain: note: the outputs of {unverified} images were written by an older vitexplain without "
            "checksums: they were only checked to exist, not verified (summary.json: unverified_outputs); "
            "rerun with --overwrite to redo them")
    if any(s.get("interrupted") for s in all_stats):
        status = "interrupted"
    elif error:
        status = "output_error"
    else:
        status = "failed" if counts["failed"] or run.unreadable else "ok"
    summary = build_summary(run, all_stats, t_start, status=status, error=error, fields=command.fields,
                            records=None if records is None else len(records))
    if signals.received:  # held while this summary was made
        summary["status"] = status = "interrupted"
    try:
        Writer(run.out).write(SUMMARY, json_bytes(summary, indent=2))
    except OSError as e:
        error = error or str(e)
        summary["error"] = error
        summary["status"] = status = "output_error"
        for s in all_stats:  # the exit code says so even when the images were all written
            s.setdefault("output_error", error)
    if error:
        left = counts["images"] - counts["ok"] - counts["failed"] - counts["skipped"]
        say(f"vitexplain {run.command}: error: {error}. The run stopped: {counts['ok']} images done, "
            f"{counts['skipped']} already current, {counts['failed']} failed, {left} not done"
            + ("" if records is not None else "; the manifest could not be merged (its parts are kept)")
            + ". Free some space (or fix the output folder) and rerun the same command to resume.")
    return summary
