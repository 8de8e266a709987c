"""One rank's processing loop: decode -> explain -> write, overlapped, interruptible.

The main thread takes decoded batches from the DataLoader, explains them (the model's
forward and backward use the intra-op threads of torch), and hands each image's write job
(overlay drawing, PNG encoding, atomic writes) to a small thread pool, so files are written
while the next batch is explained. A finished image's record is appended to the manifest
part as soon as its files are in place.

Stopping: on Ctrl-C or SIGTERM the pending write jobs (images already explained) are
finished and recorded for up to one second, the rest are cancelled (their images are redone
by the next run), and the DataLoader workers (which ignore those signals) are shut down. On
an :class:`~vitexplain.files.OutputError` (a full disk...) the pending jobs are
dropped at once and the error is reported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Optional

from .decoding import ImageDataset, make_loader
from .distributed import autocast
from .run import ProcessFn, Run, say
from .inputs import InputItem
from .integrity import RecordingWriter
from .manifest import ManifestPart
from .signals import StopSignals
from ..files import OutputError, WriteFn, Writer

__all__ = ["run_shard", "new_stats", "WRITER_NICE"]

#: How much lower the writer threads' CPU priority is than the model's (Linux ``nice`` steps,
#: per thread): drawing and writing fill the cores' idle moments instead of descheduling
#: torch's intra-op threads, whose parallel regions wait for their slowest thread.
WRITER_NICE = 5


def _writer_priority() -> None:
    """Lower this (writer) thread's priority by :data:`WRITER_NICE` (Linux only: elsewhere
    ``setpriority`` would lower the whole process)."""
    if not sys.platform.startswith("linux") or WRITER_NICE <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
    except (AttributeError, OSError):  # pragma: no cover - not permitted: run at the same priority
        pass


def _write_job(rec: dict[str, Any], write: WriteFn, writer: Writer) -> tuple[dict[str, Any], float]:
    """Run one image's write job (in a writer thread); returns (record, seconds).

    The record becomes ``ok`` with its ``files`` (and their ``checksums``, which resume verifies), or
    ``failed`` with an error and the files finished before it.

    Raises:
        OutputError: the output folder cannot be written (the run stops).
    """
    t = time.perf_counter()
    files: dict[str, dict[str, str]] = {}
    sums: dict[str, dict[str, Any]] = {}  # each finished file's size and digest: what resume verifies
    try:
        write(RecordingWriter(writer, sums), files)  # type: ignore[arg-type]  # a Writer's write, recorded
        rec["status"] = "ok"
    except OutputError:
        raise
    except Exception as e:
        rec["status"] = "failed"
        rec["error"] = f"writing the outputs of {rec['input']} failed: {type(e).__name__}: {e}"
    rec["files"] = files
    rec["checksums"] = {rel: sums[rel] for entry in files.values() for rel in entry.values() if rel in sums}
    rec["time"] = time.time()
    return rec, time.perf_counter() - t


class _Loop:
    """The state of one rank's loop (records, statistics, progress bar, write pool)."""

    def __init__(self, todo: list[tuple[InputItem, dict[str, Any]]], run: Run, part: ManifestPart,
                 stats: dict[str, Any]) -> None:
        self.todo, self.run, self.part, self.stats = todo, run, part, stats
        self.pending: deque[Future] = deque()
        self.bar: Any = None
        if not run.quiet and run.dist.rank == 0:
            from tqdm.auto import tqdm

            desc = run.command if run.dist.world == 1 else f"{run.command} (rank 0 of {run.dist.world})"
            self.bar = tqdm(total=len(todo), unit="img", file=sys.stderr, dynamic_ncols=True, desc=desc)

    def record(self, j: int, **fields: Any) -> dict[str, Any]:
        item, source = self.todo[j]
        rec = {"key": item.key, "input": item.path, "status": None, "source": source,
               "error": None, "config_hash": self.run.config_hash, "rank": self.run.dist.rank}
        if not item.path.isascii():
            try:
                item.path.encode("utf-8")
            except UnicodeEncodeError:  # undecodable name: JSON shows \xNN, this gives the bytes
                rec["input_bytes_hex"] = os.fsencode(item.path).hex()
        rec.update(fields)
        return rec

    def emit(self, rec: dict[str, Any]) -> None:
        self.part.append(rec)
        if rec["status"] == "ok":
            self.stats["ok"] += 1
        else:
            self.stats["failed"] += 1
            if len(self.stats["failures"]) < 1000:
                self.stats["failures"].append({"input": rec["input"], "error": rec["error"]})
            say(f"vitexplain: failed: {rec['error']}", self.bar)
        if self.bar is not None:
            self.bar.update(1)

    def drain(self, block_until: int) -> None:
        """Record finished write jobs (all of them while more than ``block_until`` are pending)."""
        while self.pending and (len(self.pending) > block_until or self.pending[0].done()):
            rec, seconds = self.pending.popleft().result()
            self.stats["write_s"] += seconds
            self.emit(rec)

    def stop(self, budget_s: float) -> None:
        """Finish and record pending write jobs for up to ``budget_s`` seconds; cancel the rest
        (their images are redone by the next run)."""
        deadline = time.monotonic() + budget_s
        while self.pending:
            fut = self.pending.popleft()
            try:
                rec, _ = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                fut.cancel()
                for rest in self.pending:
                    rest.cancel()
                self.pending.clear()
                return
            except CancelledError:
                continue
            except OutputError as e:
                self.stats.setdefault("output_error", str(e))
                deadline = 0.0  # the folder cannot be written: drop the rest
                continue
            try:
                self.emit(rec)
            except OutputError as e:
                self.stats.setdefault("output_error", str(e))
                deadline = 0.0


def new_stats(skipped: int) -> dict[str, Any]:
    """A rank's statistics before any image is processed."""
    return {"ok": 0, "failed": 0, "skipped": skipped, "failures": [], "load_wait_s": 0.0, "explain_s": 0.0,
            "write_s": 0.0, "process_s": 0.0, "interrupted": False}


def run_shard(
    todo: list[tuple[InputItem, dict[str, Any]]],
    *,
    run: Run,
    process: ProcessFn,
    stats: dict[str, Any],
    part: ManifestPart,
    signals: StopSignals,
) -> dict[str, Any]:
    """Process this rank's images; append their records to ``part``.

    Args:
        todo: the images to do, with their sources.
        run: the run.
        process: the command's :data:`~vitexplain.batch.driver.ProcessFn`.
        stats: this rank's statistics (:func:`new_stats`), updated as images finish (also when
            an exception leaves this function).
        part: this rank's manifest part.
        signals: the run's signals; held from the moment the loop stops.

    Returns:
        ``stats``: ``ok``, ``failed``, ``skipped``, ``failures`` (at most 1000), timings
        (``load_wait_s``, ``explain_s``, ``write_s``, ``process_s``), ``interrupted`` (the
        signal number, or False) and ``output_error`` (the message) when the run stopped.
    """
    if not todo:
        return stats
    loop = _Loop(todo, run, part, stats)
    dataset = ImageDataset([it.path for it, _ in todo], run.pre_kwargs, run.crop, run.max_side)
    batch_size = max(1, min(run.batch_size, len(todo)))  # (--batch-size past sys.maxsize: DataLoader's islice failed)
    batches_to_decode = -(-len(todo) // batch_size)  # a worker more than that only forks and waits
    loader = make_loader(dataset, batch_size=batch_size, workers=min(run.workers, batches_to_decode),
                         pin_memory=run.device.type == "cuda")
    writer = Writer(run.out)
    pool = ThreadPoolExecutor(max_workers=max(1, run.write_threads), thread_name_prefix="vitexplain-write",
                              initializer=_writer_priority)
    max_pending = max(64, 4 * batch_size)
    t0 = time.perf_counter()
    batches: Optional[Any] = None
    try:
        with signals.held():  # a signal while the workers start is raised once `batches` is set
            batches = iter(loader)
        while True:
            tw = time.perf_counter()
            try:
                x, good, bad = next(batches)
            except StopIteration:
                break
            stats["load_wait_s"] += time.perf_counter() - tw
            for s in bad:
                loop.emit(loop.record(s["i"], status="failed", error=s["error"], files={}, time=time.time()))
            if x is None:
                continue
            for s in good:
                s["key"] = todo[s["i"]][0].key
            te = time.perf_counter()
            try:
                with autocast(run.autocast_dtype):
                    jobs = process(x.to(run.device, non_blocking=True), good)
            except Exception as e:  # e.g. a method failing numerically: report, keep going
                for s in good:
                    rec = loop.record(s["i"], status="failed", files={}, time=time.time())
                    rec["error"] = f"explaining {rec['input']} failed: {type(e).__name__}: {e}"
                    loop.emit(rec)
                continue
            finally:
                stats["explain_s"] += time.perf_counter() - te
            for s, (fields, job) in zip(good, jobs):
                rec = loop.record(s["i"], width=s["width"], height=s["height"], box=s["box"], **fields)
                if isinstance(job, str):  # this image cannot be written (e.g. a non-finite map)
                    rec.update(status="failed", error=job, files={}, time=time.time())
                    loop.emit(rec)
                else:
                    loop.pending.append(pool.submit(_write_job, rec, job, writer))
            loop.drain(max_pending)
        loop.drain(0)
    except KeyboardInterrupt as e:
        stats["interrupted"] = getattr(e, "signum", signal.SIGINT)
        loop.stop(budget_s=1.0)
        say("vitexplain: interrupted; finished files are kept, rerun the same command to resume", loop.bar)
    except OutputError as e:
        stats["output_error"] = str(e)
        loop.stop(budget_s=0.0)
    finally:
        signals.defer()  # from here on the run finishes: a signal is held, never raised mid-cleanup
        pool.shutdown(wait=True, cancel_futures=True)
        batches = None  # shuts the DataLoader workers down now
        if loop.bar is not None:
            loop.bar.close()
        stats["process_s"] = time.perf_counter() - t0
    return stats
