"""Wall seconds per named phase of a piece of work, for one log line that says where its time went.

The training loop's first step (`megacpp.train.phase_clock`) and a checkpoint's save
(`megacpp.distributed.checkpoint`) both report this way; each decides what a phase's end waits for.
"""
from __future__ import annotations

import time


class PhaseTimer:
    """Each `mark(phase)` gives the seconds since the previous mark (or `restart`) to `phase`; a phase marked
    again adds to its total."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def restart(self) -> None:
        """The next phase starts now (the time since the last mark goes to no phase)."""
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def line(self, what: str) -> str:
        """E.g. ``checkpoint step_00000003 written in 79.7 s: gathering the weights 21.3 s, ...`` for `what`
        ``checkpoint step_00000003 written in``."""
        parts = ", ".join(f"{phase} {s:.1f} s" for phase, s in self.seconds.items())
        return f"{what} {sum(self.seconds.values()):.1f} s: {parts}"
