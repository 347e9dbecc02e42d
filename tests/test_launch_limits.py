"""A launch past its wall-clock limit goes with every process it started: torchrun starts its workers in
sessions of their own, so killing the launch's process group alone would leave them running (on CI's
cores in a test, on the GPUs in a benchmark). Both launchers are checked with a real torchrun whose
workers sleep past the limit."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from tests.torchrun import torchrun

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks" / "runs"


def _sleeper(tmp_path: Path) -> Path:
    """A worker that writes its pid to tmp_path/pid.<rank>, says so, and sleeps for ten minutes."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, pathlib, time\n"
                      f"pathlib.Path({str(tmp_path)!r}, 'pid.' + os.environ['RANK']).write_text(str(os.getpid()))\n"
                      "print('worker started', flush=True)\ntime.sleep(600)\n")
    return worker


def _all_gone(tmp_path: Path, ranks: int) -> bool:
    """Every worker that wrote its pid is gone, or a zombie waiting for the reaper it was handed to."""
    pids = [int(f.read_text()) for f in tmp_path.glob("pid.*")]
    assert len(pids) == ranks, f"{len(pids)} of {ranks} workers started"
    stats = [Path(f"/proc/{pid}/stat") for pid in pids]
    return all(not s.exists() or s.read_text().rsplit(")", 1)[1].split()[0] == "Z" for s in stats)


def test_tier1_a_test_launch_past_its_limit_fails_and_leaves_no_worker(tmp_path):
    with pytest.raises(AssertionError, match="a hang"):
        torchrun([str(_sleeper(tmp_path))], nproc=2, timeout=10)
    assert _all_gone(tmp_path, ranks=2)


def test_tier1_a_benchmark_job_past_its_limit_leaves_no_worker(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_dist

    args = argparse.Namespace(out=str(tmp_path), timeout_s=10.0)
    code, output, wall = bench_dist._torchrun("sleeper", 2, [str(_sleeper(tmp_path))], args,
                                              {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    assert code == "timeout" and 10.0 <= wall < 60
    assert output.count("worker started") == 2 and (tmp_path / "sleeper.log").read_text() == output
    assert _all_gone(tmp_path, ranks=2)
