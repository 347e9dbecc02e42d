"""A step watchdog: a rank that stops making progress dumps every thread's stack and exits; and a
launcher watch: a rank whose torchrun agent is gone stops.

A rank stuck in a collective (a peer died, stalled or took another code path) cannot raise: it waits
inside NCCL or gloo until the process-group timeout. After warmup the trainer arms this watchdog for
each step, evaluation and checkpoint; if the deadline passes, a daemon thread writes every thread's
Python stack to ``<run>/logs/stall_rank<R>.txt``, prints one line and ends the process with exit code
`STALL_EXIT_CODE`, and torchrun then ends the other ranks: the job stops in seconds instead of hanging.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path

STALL_EXIT_CODE = 3


class StepWatchdog:
    def __init__(self, log_dir: str | Path, rank: int) -> None:
        self.path = Path(log_dir) / f"stall_rank{rank}.txt"
        self.rank = rank
        self._deadline: float | None = None
        self._seconds = 0.0
        self._what = ""
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="megacpp-step-watchdog", daemon=True)
        self._thread.start()

    def arm(self, seconds: float, what: str) -> None:
        """Expect progress (the next `arm` or `disarm`) within `seconds`; `what` names the phase."""
        with self._wake:
            self._deadline, self._seconds, self._what = time.monotonic() + seconds, seconds, what
            self._wake.notify()

    def disarm(self) -> None:
        with self._wake:
            self._deadline = None
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        with self._wake:
            while not self._closed:
                if self._deadline is None:
                    self._wake.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(timeout=left)
                    continue
                self._fire()

    def _fire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w") as f:
            f.write(f"rank {self.rank}: no progress for {self._seconds:.0f} s during {self._what}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        sys.stderr.write(f"megacpp: error: rank {self.rank}: no progress for {self._seconds:.0f} s during "
                         f"{self._what} (a hang: a peer stalled, died or diverged); every thread's stack is in "
                         f"{self.path}; ending the job (dist.step_timeout_s sets the limit)\n")
        sys.stderr.flush()
        os._exit(STALL_EXIT_CODE)


class LauncherWatch:
    """Stops this rank, as SIGTERM would (it saves the step reached, megacpp.train.interrupt), when the
    process that launched it is gone: torchrun's agent killed with SIGKILL leaves its workers orphaned, and
    they would otherwise train on to the end holding the run directory's lock. A daemon thread compares the
    parent pid every `interval_s` (an orphan is adopted by init or a subreaper, so its parent pid changes)."""

    def __init__(self, rank: int, launcher: str, interval_s: float = 1.0) -> None:
        self.rank = rank
        self.launcher = launcher
        self.parent = os.getppid()
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megacpp-launcher-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            if os.getppid() != self.parent:
                sys.stderr.write(f"megacpp: rank {self.rank}: its launcher ({self.launcher}, pid {self.parent}) "
                                 "is gone; stopping as on SIGTERM: saving the step reached\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGTERM)
                return
