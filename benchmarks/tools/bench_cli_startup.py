"""CLI start-up: what a user waits for before `megacpp config` or `megacpp --help` answers.

    python benchmarks/tools/bench_cli_startup.py                          # this checkout, median of 5
    python benchmarks/tools/bench_cli_startup.py --trees /tmp/base . --runs 5

Each measure is a fresh interpreter (imports are cached per process) with PYTHONPATH set to the tree
being timed, so one call can compare an older checkout (e.g. ``git archive``) with this one; the
trees' runs are interleaved, so a change in machine load hits both alike. Reported per tree: wall and
CPU time (user + system of the child: steadier than wall on a shared machine) of
``python -m megacpp.cli config --preset tiny`` and ``python -m megacpp.cli --help``, the cumulative
``-X importtime`` figure of ``import megacpp.cli``, whether ``import megacpp.config`` loads
torch._dynamo; and, once, the same for ``import torch`` (the floor).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {
    "megacpp config --preset tiny": ["-m", "megacpp.cli", "config", "--preset", "tiny"],
    "megacpp --help": ["-m", "megacpp.cli", "--help"],
}


def _run(tree: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, *args], check=True, capture_output=True, text=True, env=env, cwd=tree)


def wall_and_cpu_s(tree: Path, args: list[str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    _run(tree, args)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def importtime_s(tree: Path, module: str) -> float:
    """Cumulative import time of `module` as ``-X importtime`` reports it (its own line)."""
    stderr = _run(tree, ["-X", "importtime", "-c", f"import {module}"]).stderr
    line = next(line for line in reversed(stderr.splitlines()) if line.rstrip().endswith(f"| {module}"))
    return int(line.split("|")[1]) / 1e6


def loads_dynamo(tree: Path, module: str) -> bool:
    code = f"import sys, {module}; print('torch._dynamo' in sys.modules)"
    return _run(tree, ["-c", code]).stdout.strip() == "True"


def _summary(name: str, times: list[float]) -> str:
    return f"  {name:35s} median {statistics.median(times):6.2f} s  (runs: {', '.join(f'{t:.2f}' for t in times)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="+", type=Path, default=[Path.cwd()],
                   help="checkouts to time (each must contain megacpp/); default: the current directory")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    trees = [t.resolve() for t in args.trees]
    times: dict[tuple[Path, str], list[float]] = {}

    def measure(tree: Path, name: str, command: list[str]) -> None:
        wall, cpu = wall_and_cpu_s(tree, command)
        times.setdefault((tree, f"{name}, wall"), []).append(wall)
        times.setdefault((tree, f"{name}, CPU"), []).append(cpu)

    for _ in range(args.runs):
        measure(trees[0], "import torch", ["-c", "import torch"])
        for tree in trees:
            for name, command in COMMANDS.items():
                measure(tree, name, command)
            times.setdefault((tree, "-X importtime megacpp.cli"), []).append(importtime_s(tree, "megacpp.cli"))
    for name in ("import torch, wall", "import torch, CPU"):
        print(_summary(name, times.pop((trees[0], name))))
    for tree in trees:
        print(f"{tree} (import megacpp.config loads torch._dynamo: {loads_dynamo(tree, 'megacpp.config')})")
        for (t, name), values in times.items():
            if t == tree:
                print(_summary(name, values))


if __name__ == "__main__":
    main()
