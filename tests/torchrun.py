"""Run a script or the megacpp CLI under torchrun (gloo, CPU) from a test, always under a timeout.

A hang must fail the test, never stall CI: every launch has a wall-clock limit, and on expiry the
launch is killed with every process it started (torchrun starts its workers in sessions of their own, so
the launch's process group alone would leave them running on CI's cores).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "runs"))  # the benchmarks' runner kills a launch the same way
from run_dirs import kill_tree  # noqa: E402


@dataclass
class Launch:
    returncode: int
    output: str
    seconds: float

    def check(self) -> Launch:
        assert self.returncode == 0, f"exit {self.returncode} after {self.seconds:.0f} s:\n{self.output[-6000:]}"
        return self


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")  # two ranks on a 2-core machine
    env.pop("WORLD_SIZE", None)
    env.update(extra or {})
    return env


def torchrun_args(nproc: int, port: int, nnodes: int = 1, node_rank: int = 0) -> list[str]:
    """torchrun meeting at 127.0.0.1:port, as on several hosts (--nnodes, --node-rank, --rdzv-endpoint)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            f"--node-rank={node_rank}", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--monitor-interval=1", "--max-restarts=0",
            "--tee=3"]  # each worker line prefixed "[default<rank>]:" and never cut by another's


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Launch:
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s (a hang):\n{out[-6000:]}") from None
    return Launch(proc.returncode, out, time.monotonic() - start)


def python(target: list[str], timeout: float = 240, env: dict[str, str] | None = None) -> Launch:
    """One plain process (`python <target>`), the single-rank side of a comparison."""
    return run([sys.executable, *target], timeout, env)


def torchrun(target: list[str], nproc: int = 2, timeout: float = 240, env: dict[str, str] | None = None) -> Launch:
    """`torchrun --nproc-per-node=nproc <target>`; target is a script path plus its arguments, or
    ["-m", module, ...]."""
    return run([*torchrun_args(nproc, free_port()), *target], timeout, env)


def two_nodes(target: list[str], timeout: float = 240, env: dict[str, str] | None = None) -> list[Launch]:
    """Two torchrun "nodes" of one process each on this machine, meeting at one rendezvous address."""
    port = free_port()
    start = time.monotonic()
    procs = [subprocess.Popen([*torchrun_args(1, port, nnodes=2, node_rank=i), *target], cwd=ROOT,
                              env=worker_env({**(env or {}), "TEST_NODE_INDEX": str(i)}),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for i in range(2)]
    results = []
    for proc in procs:
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            out, _ = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            for p in procs:
                kill_tree(p.pid)
            raise AssertionError("two-node launch timed out (a hang)") from None
        results.append(Launch(proc.returncode, out, time.monotonic() - start))
    return results
