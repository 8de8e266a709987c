"""How many torch intra-op threads a job should use on a small or shared CPU.

torch starts one intra-op thread per core and its parallel regions wait for every thread, so
a job whose threads outnumber the cores it really gets (another job, decode workers, writer
threads) waits on the descheduled ones at every kernel. ``benchmarks/threads.py`` measures it
(docs/benchmarks.md, "Torch threads on a shared CPU"): on 2 cores with one competing
process, 2 threads ran the zoo ViT's ``explain`` 14x and the training of the tiny transformer
of ``examples/alignment.py`` 18x slower than 1 thread, while a second thread can at most
halve the time. So the rule leaves one core to someone else::

    import vitexplain as vx
    vx.threads.limit()          # torch.set_num_threads(vx.threads.pick()) unless chosen already
    vx.threads.pick()           # max(1, min(CPUs - 1, CPUs - load average)): 1 on 2 cores

A choice already made is kept: :func:`limit` changes nothing when ``OMP_NUM_THREADS`` or
``MKL_NUM_THREADS`` is set, or when torch's thread count is not its start-up default
(someone called ``torch.set_num_threads``).

The batch commands (``export``, ``caption``, ``explore``) take ``--threads N``; on the command
line it defaults to ``pick(reserve=0)`` (:func:`default_for_cli`: every core other jobs leave
idle; a larger model gains from a second thread when the machine is idle), while their Python API leaves torch
as it is unless ``threads`` is given, and restores it afterwards (:func:`using`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Optional

__all__ = ["cpus", "pick", "limit", "chosen_by_user", "using", "default_for_cli", "ENV_VARS"]

#: environment variables by which a user chooses the thread count (kept by :func:`limit`).
ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def pick(cap: Optional[int] = None, *, reserve: int = 1) -> int:
    """The thread count for a torch job here: ``max(1, min(CPUs - reserve, CPUs - load))``.

    ``load`` is the 1-minute load average (other jobs running; 0 where the OS has none),
    rounded: threads beyond the cores other jobs leave idle only wait.

    Args:
        cap: at most this many (None: no cap).
        reserve: cores always left free. 1 (the default) suits small models, which a second
            thread speeds up little, and leaves a core to a job that starts later; the batch
            commands use 0 (every idle core, as torch would, but none that is busy).

    Returns:
        At least 1.
    """
    n = cpus()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - Windows
        load = 0.0
    count = max(1, min(n - max(0, int(reserve)), int(n - load + 0.5)))
    return max(1, min(count, cap)) if cap else count


def chosen_by_user() -> bool:
    """True when the thread count was chosen: an :data:`ENV_VARS` variable is set, or torch's
    count is not one of its start-up defaults (one per CPU, or one per physical core on CPUs
    with two hardware threads per core)."""
    import torch

    if any(os.environ.get(v, "").strip() for v in ENV_VARS):
        return True
    return torch.get_num_threads() not in (cpus(), max(1, cpus() // 2))


def limit(cap: Optional[int] = None) -> int:
    """Lower torch's intra-op threads to :func:`pick` unless the user chose them (:func:`chosen_by_user`).

    Never raises the count.

    Args:
        cap: passed to :func:`pick`.

    Returns:
        torch's thread count afterwards.
    """
    import torch

    if not chosen_by_user():
        torch.set_num_threads(min(torch.get_num_threads(), pick(cap)))  # never more than before
    return torch.get_num_threads()


@contextmanager
def using(count: Optional[int]) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` inside the block and restored after it.

    Args:
        count: threads (at least 1), or None to leave torch as it is.
    """
    if count is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(count)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_for_cli() -> Optional[int]:
    """The batch commands' ``--threads`` default: ``pick(reserve=0)`` (torch's count on an idle
    machine, fewer when other jobs keep cores busy), or None (torch's own setting) when
    ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` chose it (``torchrun`` sets one per process)."""
    if any(os.environ.get(v, "").strip() for v in ENV_VARS):
        return None
    return pick(reserve=0)
