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
from typing import Any

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


class WaitReporter:
    """Says, on a rank blocked in a collective, which ranks it waits for and what they are doing.

    Before the step watchdog is armed (warmup: every rank compiles, for minutes, at its own pace) a rank
    that reaches a collective first waits without a word, up to `dist.init_timeout_s`. A daemon thread
    samples the main thread's Python stack every `interval_s` and publishes what it does on the job store
    (``compiling``, ``in a collective`` or the code it runs); when the main thread has sat on one bytecode
    inside torch.distributed for an interval, the rank prints one line naming the peers that are not in a
    collective and what they do, again every interval while it waits. An NCCL tensor collective returns at
    once and the host waits at the next CUDA synchronization instead: a rank blocked there is reported when
    some peer compiles or runs.
    """

    KEY = "megacpp/activity/{rank}"

    def __init__(self, store: Any, rank: int, world_size: int, interval_s: float, log: Any = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megacpp-wait-reporter", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        last, blocked_s = None, 0.0
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self._main)
            if frame is None:
                return
            here = (id(frame.f_code), frame.f_lineno, frame.f_lasti)
            blocked_s = blocked_s + self.interval_s if here == last else 0.0
            last = here
            state, code = activity(frame)
            try:
                self.store.set(self.KEY.format(rank=self.rank), f"{state}|{code}|{int(blocked_s > 0)}")
                if blocked_s > 0 and state != "compiling":
                    self._report(state, code, blocked_s)
            except RuntimeError:  # the store's host is gone (the job is ending): nothing left to say
                return

    def _report(self, state: str, code: str, blocked_s: float) -> None:
        """In a collective: every peer outside one is what this rank waits for. Blocked elsewhere (an NCCL
        collective awaited at a CUDA synchronization): peers compiling or running unblocked are."""
        awaited = []
        for peer in range(self.world_size):
            key = self.KEY.format(rank=peer)
            if peer == self.rank or not self.store.check([key]):
                continue
            their_state, their_code, their_blocked = self.store.get(key).decode().split("|")
            if their_state != "in a collective" and (state == "in a collective" or their_state == "compiling"
                                                     or their_blocked == "0"):
                awaited.append(f"rank {peer} ({their_state}, at {their_code})")
        if state == "in a collective" or awaited:
            whom = "; ".join(awaited[:8]) + (", ..." if len(awaited) > 8 else "") if awaited else \
                "the others, all in collectives too (a hang: dist.init_timeout_s, later the step watchdog, ends it)"
            where = "in a collective" if state == "in a collective" else "at a synchronization"
            self._log(f"megacpp: rank {self.rank}: waiting {blocked_s:.0f} s {where} at {code} for {whom}")


def activity(frame: Any) -> tuple[str, str]:
    """What a thread at `frame` does: ('compiling' | 'in a collective' | 'running', its innermost code
    outside torch, as 'file:line function')."""
    files = []
    while frame is not None:
        files.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    torch_dir = f"{os.sep}torch{os.sep}"
    if any(f"{torch_dir}_dynamo{os.sep}" in f or f"{torch_dir}_inductor{os.sep}" in f for f, _, _ in files):
        state = "compiling"
    elif any(f.endswith(f"distributed{os.sep}distributed_c10d.py") for f, _, _ in files):
        state = "in a collective"
    else:
        state = "running"
    own = next(((f, line, name) for f, line, name in files if torch_dir not in f), files[0])
    return state, f"{_short(own[0])}:{own[1]} {own[2]}"


def _short(path: str) -> str:
    """'megacpp/train/loop.py' from an absolute path: the part a reader recognises."""
    for anchor in (f"{os.sep}megacpp{os.sep}", f"{os.sep}tests{os.sep}"):
        if anchor in path:
            return path[path.rindex(anchor) + 1:]
    return Path(path).name
