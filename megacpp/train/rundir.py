"""The run directory belongs to one run at a time, and a new run never destroys an old one's files.

`claim_run_dir` is called once, by rank 0, before any data or model work:
- a lock file (``<out_dir>/.megacpp.lock``, holding the owner's pid and host) is held for the whole run,
  so a second run on the same directory refuses at once instead of interleaving checkpoints;
- a directory that already holds a run's checkpoints or metrics is refused unless the run continues it
  (``--resume``) or replaces it (``train.overwrite``), in which case the old files are moved into
  ``<out_dir>/previous-<timestamp>/``, never deleted. A run that left no checkpoint to resume from (it
  failed before its first, or its only ones were set aside as diverged) is moved there too, unasked:
  refusing would leave the user no command that continues it.
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

from filelock import FileLock, Timeout

from megacpp.errors import MegacppError
from megacpp.run_files import LOCK_NAME, PREVIOUS_PREFIX, RUN_ENTRIES, RUN_PATTERNS
from megacpp.runtime.checkpoint import checkpoint_root, list_checkpoints


class RunDirError(MegacppError):
    """The run directory is in use by another process, or holds a run this one would destroy."""


def previous_run_files(out_dir: Path) -> list[str]:
    """What marks `out_dir` as holding a run: checkpoints (finished or half-written) or metrics."""
    found = []
    root = checkpoint_root(out_dir)
    if root.is_dir() and any(p.name.startswith("step_") for p in root.iterdir()):
        found.append(f"{root.name}/")
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(metrics.name)
    return found


def move_aside(out_dir: Path, entries: tuple[str, ...] = RUN_ENTRIES, patterns: tuple[str, ...] = RUN_PATTERNS) -> Path:
    """Move what megacpp wrote in `out_dir` (`entries` and names matching `patterns`; by default all of it)
    into a new ``previous-<timestamp>/`` folder of it; return that folder. Nothing else in `out_dir` moves."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = out_dir / f"{PREVIOUS_PREFIX}{stamp}"
    n = 1
    while target.exists():  # two overwrites within one second
        target, n = out_dir / f"{PREVIOUS_PREFIX}{stamp}-{n}", n + 1
    target.mkdir()
    for entry in sorted(out_dir.iterdir()):
        if entry.name in entries or any(entry.match(pattern) for pattern in patterns):
            os.replace(entry, target / entry.name)
    return target


class RunLock:
    """An exclusive, non-blocking lock on a run directory; the lock file names its holder."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_NAME
        self._lock = FileLock(self.path, timeout=0)

    def acquire(self) -> None:
        try:
            self._lock.acquire()
        except Timeout:
            owner = _read_owner(self.path)
            raise RunDirError(f"train.out_dir {self.path.parent} is in use by another run ({owner}); wait for "
                              "it to finish or choose another --train.out_dir") from None
        self.path.write_text(f"pid {os.getpid()} on {platform.node()}\n")

    def release(self) -> None:
        if self._lock.is_locked:
            self.path.write_text("")  # a stale owner would mislead the next refusal's message
            self._lock.release()


def _read_owner(path: Path) -> str:
    try:
        return path.read_text().strip() or "process unknown"
    except OSError:
        return "process unknown"


def claim_run_dir(out_dir: Path, resume: bool, overwrite: bool, log) -> RunLock:
    """Lock `out_dir` for this run and make sure starting it loses nothing (see the module docstring).
    Returns the held lock; raises `RunDirError` (lock released) when the run must not start."""
    if resume and overwrite:
        raise RunDirError(f"--resume and train.overwrite both given for {out_dir}: continue the run there "
                          "(--resume) or replace it (--train.overwrite true), not both")
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out_dir)
    lock.acquire()
    try:
        found = [] if resume else previous_run_files(out_dir)
        if found and overwrite:
            log(f"train.overwrite: moved the previous run's files to {move_aside(out_dir)}")
        elif found and not list_checkpoints(out_dir):
            log(f"train.out_dir {out_dir} holds a run with no checkpoint to resume from ({', '.join(found)}): "
                f"starting over; its files moved to {move_aside(out_dir)}")
        elif found:
            raise RunDirError(
                f"train.out_dir {out_dir} already holds a run ({', '.join(found)}): continue it with --resume, "
                f"or start over with --train.overwrite true (moves its files into {out_dir}/{PREVIOUS_PREFIX}"
                "<time>/), or choose another --train.out_dir")
    except BaseException:
        lock.release()
        raise
    return lock


def start_over(out_dir: Path) -> str:
    """A `--resume` that found no usable checkpoint starts from step 0: the old metrics.jsonl (steps this
    run logs again) and checkpoints/ (broken ones, which this run's would replace) move into
    ``previous-<timestamp>/``, so nothing of the old run is overwritten or appended to. Returns what moved."""
    entries = ("metrics.jsonl", checkpoint_root(out_dir).name)
    present = [name for name in entries if (out_dir / name).exists()]
    if not present:
        return "starting from step 0"
    return f"starting from step 0; the old {' and '.join(present)} moved to {move_aside(out_dir, entries, ())}"
