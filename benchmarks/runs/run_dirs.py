"""Shared by the scripts of benchmarks/runs: a run named on the command line (`dir` or `label=dir`) and its
metrics, with one-line errors instead of tracebacks; a command run with its output in a log."""
from __future__ import annotations

import os
import signal
import subprocess
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
    """Run ``cmd`` with its output in ``log``: its exit code as text, or "timeout". On the timeout its whole
    process group is killed: a torchrun's workers, not only torchrun."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        try:
            return str(proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"
