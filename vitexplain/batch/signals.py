"""Ctrl-C and SIGTERM during a batch run: stop the work once, never cut the finishing short.

A run is interruptible while it explains images: the first SIGINT or SIGTERM raises
:class:`KeyboardInterrupt` (:class:`Interrupted` for SIGTERM) in the main thread, and the
run finishes the files in flight, merges the manifest and writes the summary. From then on,
and whenever the run is finishing (merging the manifest parts, writing the gallery and
``summary.json``), signals are only recorded (:class:`StopSignals`): a second Ctrl-C or a
SIGTERM sent while the summary is written cannot leave a folder without its summary. The
recorded signal is raised once the run has finished and released its lock.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, Optional

__all__ = ["Interrupted", "StopSignals", "interrupt_for", "signals_as_interrupts"]


class Interrupted(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C (finished work recorded, summary written).

    Attributes:
        signum: the signal received.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def interrupt_for(signum: int) -> KeyboardInterrupt:
    """The exception a signal ends a run with: KeyboardInterrupt for SIGINT, else :class:`Interrupted`."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Interrupted` in the main thread (Ctrl-C already
    raises KeyboardInterrupt). No-op outside the main thread; the old handler is restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        raise Interrupted(signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class StopSignals:
    """SIGINT and SIGTERM of one run (a context manager; main thread only, else a no-op).

    The first signal raises (see the module docstring) unless :meth:`defer` was called; every
    signal is recorded in :attr:`received`.

    Attributes:
        received: the signals received, in order.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._deferred = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self._SIGNALS:
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handler(self, signum: int, _frame: Any) -> None:
        self.received.append(signum)
        if not self._deferred:
            self._deferred = True  # only once: the run is stopping now
            raise interrupt_for(signum)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Within the block a signal is only recorded, and raised when the block ends (unless the
        run is already finishing): ``with signals.held(): batches = iter(loader)``.

        A signal that arrived while DataLoader workers were starting raised in the main process
        with the iterator half-built (its workers, which ignore SIGTERM, were never shut down: the
        process hung at exit joining them) and, by the handler forked into them, in half-started
        workers (a traceback each). Held, it is raised once the iterator is assigned, and a worker
        forked meanwhile only records it.
        """
        if self._deferred:
            yield
            return
        self._deferred = True
        before = len(self.received)
        try:
            yield
        finally:
            self._deferred = False
        if len(self.received) > before:
            self._deferred = True
            raise interrupt_for(self.received[before])

    def defer(self) -> None:
        """From now on only record signals (the run is finishing)."""
        self._deferred = True

    @property
    def first(self) -> Optional[int]:
        """The first signal received, or None."""
        return self.received[0] if self.received else None
