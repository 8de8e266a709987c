"""Helpers shared by the benchmark scripts: interleaved timing and the report file."""

from __future__ import annotations

import datetime
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

REPORT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def sync(device: str | torch.device = "cpu") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved_times(fns: dict[str, Callable[[], object]], *, reps: int = 10, warmup: int = 2,
                      device="cpu", clock: Callable[[], float] = time.perf_counter,
                      shuffle_seed: Optional[int] = None) -> dict[str, list[float]]:
    """Times (s) of ``reps`` runs of each function, interleaved so drift hits all alike.

    ``clock``: wall time by default; ``time.process_time`` gives this process's CPU time (with one
    thread, the work done, which other processes on a shared machine do not inflate).
    ``shuffle_seed``: run the functions of each round in a new random order (seeded), so that no
    function always runs after the same other one (what one leaves behind, freed memory the C
    allocator keeps or gives back, changes what the next one pays); None keeps the given order."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    rng = random.Random(shuffle_seed)
    for _ in range(reps):
        if shuffle_seed is not None:
            rng.shuffle(order)
        for name in order:
            fn = fns[name]
            sync(device)
            start = clock()
            fn()
            sync(device)
            times[name].append(clock() - start)
    return times


def median_times(fns: dict[str, Callable[[], object]], *, reps: int = 10, warmup: int = 2, device="cpu",
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median time (s) of each function (``clock`` as in :func:`interleaved_times`); runs are interleaved."""
    return {name: statistics.median(t) for name, t in interleaved_times(fns, reps=reps, warmup=warmup,
                                                                          device=device, clock=clock).items()}


def held_bytes(records) -> int:
    """Bytes of the distinct tensor storages a capture's records reference (q, k, v, mask, probabilities)."""
    seen: dict[int, int] = {}
    for r in records:
        for t in (r._q, r._k, r._v, r._mask, r._probs):
            if isinstance(t, torch.Tensor):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def machine() -> str:
    threads = torch.get_num_threads()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.processor() or platform.machine()}, {threads} torch threads, {gpu}, torch {torch.__version__}"


def table(header: list[str], rows: list[list[object]]) -> str:
    """A GitHub-markdown table."""
    def fmt(v: object) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def report(section: str, body: str, *, print_only: bool = False) -> None:
    """Print ``body`` and store it in docs/benchmarks.md under ``## section``.

    The section records the command and date; rerunning a script replaces its section. ``print_only`` (a
    script's ``--no-report``): print it, store nothing.
    """
    script = Path(sys.argv[0]).resolve()
    root = Path(__file__).resolve().parent.parent
    shown = script.relative_to(root).as_posix() if script.is_relative_to(root) else script.name
    command = "python " + " ".join([shown, *sys.argv[1:]])
    stamp = datetime.date.today().isoformat()
    text = f"## {section}\n\n`{command}` — {stamp}, {machine()}\n\n{body}\n"
    print(text)
    if print_only:
        return
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    old = REPORT.read_text() if REPORT.exists() else "# Benchmarks\n\nEvery table here is written by a script in `benchmarks/`; rerun it to refresh.\n\n"
    pattern = re.compile(rf"^## {re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    new = pattern.sub(lambda _: text + "\n", old) if pattern.search(old) else old.rstrip() + "\n\n" + text
    REPORT.write_text(new)
