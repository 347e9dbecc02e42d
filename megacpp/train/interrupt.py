"""Ctrl-C as a request, not an exception: SIGINT sets a flag that the trainer reads at the step boundary.

A KeyboardInterrupt raised mid-step would leave optimizer state half-updated and, under torchrun, one
rank inside a collective that its peers never enter. With the flag every rank finishes its step, the
ranks agree (a max over the flags, reduced with each step's loss: torchrun gives SIGINT to every rank,
not always between the same steps), and all of them save one checkpoint together. Further SIGINTs
while saving (a terminal's Ctrl-C reaches the workers directly and again through torchrun) only set the
flag again.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType


class SigintFlag:
    """Within ``with``: SIGINT sets `requested` (main thread only: Python delivers signals there)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, _signum: int, _frame: FrameType | None) -> None:
        self.requested = True

    def __enter__(self) -> SigintFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
