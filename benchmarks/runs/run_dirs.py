"""Shared by the scripts of benchmarks/runs: a run named on the command line (`dir` or `label=dir`) and its
metrics, with one-line errors instead of tracebacks; a command run with its output in a log."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from megacpp.train.metrics import read_metrics


def parse_run_arg(arg: str) -> tuple[str, Path]:
    """(label, directory) of `dir` or `label=dir`. Either part may hold '=': the label ends at the first
    '=' that is followed by an existing directory; an argument that is a directory has no label (its
    name is the label)."""
    if Path(arg).is_dir():
        return Path(arg).name, Path(arg)
    for i, char in enumerate(arg):
        if char == "=" and Path(arg[i + 1:]).is_dir():
            return arg[:i] or Path(arg[i + 1:]).name, Path(arg[i + 1:])
    raise SystemExit(f"{arg}: no such run directory (expected DIR or LABEL=DIR)")


def run_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a run directory's metrics.jsonl."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"{path}: no metrics.jsonl (not a megacpp run directory, or a run that never started)")
    records = read_metrics(metrics)
    if not records:
        raise SystemExit(f"{metrics}: no complete record (empty, or the run was killed before writing one)")
    return records


def step_window(text: str, option: str) -> tuple[int, int]:
    """`first:last` (inclusive) as two ints; SystemExit naming `option` otherwise."""
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(first), int(last)
    except ValueError:
        raise SystemExit(f"{option} {text!r}: expected FIRST:LAST step numbers, e.g. 100:300") from None


def run_logged(cmd: list[str], log: Path, timeout_s: float | None, cwd: Path | None = None,
               env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` with its output in ``log``: its exit code as text, or "timeout". On the timeout every
    process it started is killed with it: torchrun starts its workers in sessions of their own, so its
    process group alone would leave them running (and holding their GPUs)."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        try:
            return str(proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            return "timeout"


def kill_tree(pid: int, wait_s: float = 10.0) -> None:
    """SIGKILL to `pid`, its process group and every process below it (read from /proc before the first
    kill, since a killed parent's children are handed to init and drop out of the tree), then wait up to
    `wait_s` for those below to be gone: a signalled process dies when it is next scheduled, which on a busy
    CPU can be after this returns (a worker seen alive just after the kill failed a test under load)."""
    below = descendants(pid)
    with contextlib.suppress(ProcessLookupError):  # the launch itself may have ended already
        os.killpg(pid, signal.SIGKILL)
    for child in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(_alive(child) for child in below) and time.monotonic() < deadline:
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    """Whether `pid` still runs: not gone and not a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, their children, ...), from /proc; [] where there is none."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name before ")" may hold spaces
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found
