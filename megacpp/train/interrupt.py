"""Ctrl-C and SIGTERM as requests, not exceptions: the signal sets a flag the trainer reads at the step
boundary.

A KeyboardInterrupt raised mid-step would leave optimizer state half-updated and, under torchrun, one
rank inside a collective that its peers never enter. With the flag every rank finishes its step, the
ranks agree (a max over the flags, reduced with each step's loss: torchrun gives the signal to every
rank, not always between the same steps), and all of them save one checkpoint together.

SIGTERM is what schedulers send before they kill a job (SLURM's preemption, Kubernetes' termination
grace period) and what torchrun sends its workers when its own run ends or a second Ctrl-C arrives: it
is handled like Ctrl-C, and the run exits 143 (128 + SIGTERM) after saving, where Ctrl-C exits 130.
Further signals while saving only set the flag again, so the save a first signal started is never cut
short by the second.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Within ``with``: SIGINT and SIGTERM set `requested` and `received` (the first of them) instead of
    ending the process (main thread only: Python delivers signals there)."""

    def __init__(self) -> None:
        self.requested = False
        self.received: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.requested = True
        if self.received is None:
            self.received = signal.Signals(signum)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
