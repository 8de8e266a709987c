"""How many torch intra-op threads a job should use on a small or shared CPU.

torch starts one intra-op thread per core and its parallel regions wait for every thread, so
a job whose threads outnumber the cores it really gets (another job, decode workers, writer
threads) waits on the descheduled ones at every kernel. ``benchmarks/threads.py`` measures it
(docs/benchmarks.md, "Torch threads on a shared CPU"): on 2 cores with one competing
process, the zoo ViT's ``explain`` ran 17x slower with 2 threads than with 1, and training
the tiny transformer of ``examples/alignment.py`` 9x slower, while a second thread gains at
most 2x when the machine is idle. So the rule leaves one core to someone else::

    import vitexplain as vx
    vx.threads.limit()          # torch.set_num_threads(vx.threads.pick()) unless chosen already
    vx.threads.pick()           # max(1, min(CPUs - 1, CPUs - load average)): 1 on 2 cores

A choice already made is kept: :func:`limit` changes nothing when ``OMP_NUM_THREADS`` or
``MKL_NUM_THREADS`` is set, or when torch's thread count is not its start-up default
(someone called ``torch.set_num_threads``).
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["cpus", "pick", "limit", "chosen_by_user", "ENV_VARS"]

#: environment variables by which a user chooses the thread count (kept by :func:`limit`).
ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def pick(cap: Optional[int] = None) -> int:
    """The thread count for a torch job here: ``max(1, min(CPUs - 1, CPUs - load))``.

    ``load`` is the 1-minute load average (other jobs running; 0 where the OS has none),
    rounded. One core is always left free (for a second job, decode workers or writer threads).

    Args:
        cap: at most this many (None: no cap).

    Returns:
        At least 1.
    """
    n = cpus()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - Windows
        load = 0.0
    count = max(1, min(n - 1, int(n - load + 0.5)))
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
