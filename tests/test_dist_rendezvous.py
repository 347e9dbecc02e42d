"""The edges of a multi-process job: ranks that cannot meet, and a peer that dies (issue 39).

Each case asserts the exit code, one line naming the problem on every rank involved, no Python traceback
from any rank, and that nothing on disk was lost. Ranks that cannot meet are started as plain processes
with hand-made torchrun variables (MASTER_ADDR/PORT, RANK, WORLD_SIZE), since torchrun itself never
launches a mismatched world; every launch runs under a wall-clock limit, so a hang fails the test.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from filelock import FileLock

from megacpp.runtime.checkpoint import list_checkpoints, verify_checkpoint
from tests.helpers import tiny_train_args, write_corpus
from tests.torchrun import ROOT, Launch, free_port, torchrun, torchrun_args, worker_env

pytestmark = pytest.mark.slow

LAUNCH = "tests/distributed/launch.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("rdzv") / "corpus"
    write_corpus(root)
    return root


def train_args(tmp_path, corpus, **overrides: str) -> list[str]:
    return tiny_train_args(tmp_path, corpus, **{"train.batch_size": "2", **overrides})


def plain_ranks(ranks: list[tuple[int, int]], args: list[str], timeout: float, port: int | None = None,
                stagger_s: float = 0.0) -> list[Launch]:
    """Start `megacpp <args>` once per (RANK, WORLD_SIZE), as a launcher that sets the variables by hand
    would; each process's output, exit code and seconds. All are killed when `timeout` passes (a hang)."""
    port = port or free_port()
    start = time.monotonic()
    procs = []
    for rank, world in ranks:
        env = worker_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                          "LOCAL_RANK": "0", "WORLD_SIZE": str(world)})
        procs.append(subprocess.Popen([sys.executable, "-m", "megacpp.cli", *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
        time.sleep(stagger_s)
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            raise AssertionError(f"a rank outlived the {timeout} s limit (a hang)") from None
        results.append(Launch(proc.returncode, out, time.monotonic() - start))
    return results


def one_error(output: str) -> str:
    """The one error line a process printed, after asserting it printed exactly one and no traceback."""
    assert "Traceback" not in output, output[-3000:]
    found = re.findall(r"^megacpp: (?:config )?error: (.*)$", output, flags=re.M)
    assert len(found) == 1, output[-3000:]
    return found[0]


def worker_lines(output: str) -> str:
    """What torchrun's workers printed (its agent prints a traceback of its own for any failed worker)."""
    return "\n".join(line for line in output.splitlines() if re.match(r"\[default\d+\]:", line))


# ---------------------------------------------------------------- 1. ranks that cannot meet


def test_a_rank_launched_alone_says_what_it_waits_for_and_stops_at_its_init_timeout(tmp_path, corpus):
    (rank0,) = plain_ranks([(0, 2)], train_args(tmp_path, corpus, **{"dist.init_timeout_s": "8"}), timeout=90)
    assert rank0.returncode == 1
    waits = re.findall(r"^megacpp: rank 0 of 2: waiting for the other ranks at 127\.0\.0\.1:\d+: "
                       r"1 of 2 ranks joined \(missing: 1\) after (\d+) s", rank0.output, flags=re.M)
    assert len(waits) >= 2, f"a report every 2 s of the 8 s wait:\n{rank0.output[-3000:]}"
    error = one_error(rank0.output)
    assert error.startswith("rank 0 of 2: only 1 of 2 ranks joined (missing: 1) within dist.init_timeout_s = 8 s")
    assert 8 <= rank0.seconds < 60, "it waits its own timeout, and not beyond"


def test_ranks_with_different_world_sizes_stop_at_once_naming_both(tmp_path, corpus):
    """The init timeout is long (600 s): the disagreement stops both ranks long before it."""
    results = plain_ranks([(0, 2), (1, 3)], train_args(tmp_path, corpus, **{"dist.init_timeout_s": "600"}),
                          timeout=120, stagger_s=1.0)
    for result in results:
        assert result.returncode == 1
        error = one_error(result.output)
        assert "WORLD_SIZE disagrees between ranks at 127.0.0.1:" in error
        assert "rank 1 has 3, rank 0 has 2" in error, error
        assert result.seconds < 90
    assert not (tmp_path / "run").exists() or not list_checkpoints(tmp_path / "run")


# ---------------------------------------------------------------- 3. rendezvous errors


def test_a_rank_launched_twice_stops_every_rank_waiting_to_meet(tmp_path, corpus):
    """RANK 1 twice in a job of 3: ranks 0 and 1 wait for rank 2 when the second RANK 1 arrives."""
    results = plain_ranks([(0, 3), (1, 3), (1, 3)], train_args(tmp_path, corpus, **{"dist.init_timeout_s": "600"}),
                          timeout=120, stagger_s=1.0)
    errors = [one_error(r.output) for r in results]
    assert all(r.returncode == 1 for r in results)
    assert all(e.startswith("RANK=1 was launched twice at 127.0.0.1:") for e in errors), errors
    assert all(r.seconds < 90 for r in results), "at once, not at the 600 s init timeout"


def test_rank_0_launched_twice_cannot_host_the_store_and_says_so(tmp_path, corpus):
    first, second = plain_ranks([(0, 2), (0, 2)], train_args(tmp_path, corpus, **{"dist.init_timeout_s": "6"}),
                                timeout=90, stagger_s=2.0)
    assert second.returncode == 1
    assert "rank 0 cannot host the job store at 127.0.0.1:" in one_error(second.output)
    assert first.returncode == 1 and "only 1 of 2 ranks joined" in one_error(first.output)


def test_a_store_that_never_comes_is_reported_and_ends_at_the_init_timeout(tmp_path, corpus):
    """Rank 1 without its rank 0: the job store it must reach is hosted by nobody."""
    (rank1,) = plain_ranks([(1, 2)], train_args(tmp_path, corpus, **{"dist.init_timeout_s": "6"}), timeout=90)
    assert rank1.returncode == 1
    assert re.search(r"^megacpp: rank 1 of 2: waiting for the job store at 127\.0\.0\.1:\d+ \(hosted by rank 0\): "
                     r"not reachable for \d+ s", rank1.output, flags=re.M), rank1.output[-3000:]
    error = one_error(rank1.output)
    assert "the job store at 127.0.0.1:" in error and "was not reachable within dist.init_timeout_s = 6 s" in error
    assert 6 <= rank1.seconds < 60


# ---------------------------------------------------------------- 2. a peer that died


def test_a_peer_killed_mid_run_is_one_line_on_the_survivor_and_keeps_the_checkpoint(tmp_path, corpus):
    result = torchrun([LAUNCH, "--fault", "kill@1:5", *train_args(tmp_path, corpus, **{"dist.step_timeout_s": "60"})],
                      timeout=240)
    assert result.returncode != 0
    workers = worker_lines(result.output)
    assert "Traceback" not in workers, workers[-3000:]
    (error,) = re.findall(r"^\[default0\]:megacpp: error: (.*)$", workers, flags=re.M)
    # gloo says "Connection closed by peer [addr]:port" or "Read error [addr]:port: Connection reset by peer"
    assert error.startswith("rank 0: a peer rank died during a collective (") and "by peer" in error, error
    (ckpt,) = list_checkpoints(tmp_path / "run")  # step 3's, written before the kill in step 5
    assert verify_checkpoint(ckpt)["world_size"] == 2


# ---------------------------------------------------------------- 4. waits during warmup


def test_a_rank_waiting_for_a_slow_peer_in_warmup_says_for_whom(tmp_path, corpus):
    """Rank 1 spends 18 s more on its first step, as a slow compile would: rank 0, blocked in that step's
    collective, names rank 1 and where it is (a report every 6 s: a quarter of dist.init_timeout_s)."""
    result = torchrun([LAUNCH, "--fault", "slow_warmup@1:18",
                       *train_args(tmp_path, corpus, **{"dist.init_timeout_s": "24"})], timeout=240).check()
    workers = worker_lines(result.output)
    assert "Traceback" not in workers
    assert re.search(r"^\[default0\]:megacpp: rank 0: waiting \d+ s in a collective at megacpp/\S+ \S+ for rank 1 "
                     r"\(running, at tests/distributed/launch\.py:\d+ slow_first_step\)$", workers, flags=re.M), \
        workers[-3000:]
    assert not re.search(r"^\[default1\]:megacpp: rank 1: waiting", workers, flags=re.M), "rank 1 is the busy one"
    assert len(list_checkpoints(tmp_path / "run")) == 2


# ---------------------------------------------------------------- 5. orphaned ranks


def processes_mentioning(text: str) -> list[int]:
    """Pids of the processes whose command line holds `text` (the test's own run directory)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(entry))
    return pids


@pytest.mark.parametrize("supervised", [False, True])
def test_ranks_whose_torchrun_agent_was_killed_stop_saving_the_step_reached(tmp_path, corpus, supervised):
    """Unsupervised (CPU) the rank sees its parent go; under the auto-fit supervisor (every CUDA run; on
    CPU through the test hook) the supervisor does and sends its child SIGTERM, which saves."""
    run_dir = tmp_path / "run"
    logs = tmp_path / "torchrun_logs"
    cmd = [*torchrun_args(2, free_port()), f"--log-dir={logs}", LAUNCH,
           *train_args(tmp_path, corpus, **{"train.steps": "500", "train.ckpt_every": "1000",
                                            "train.eval_every": "1000"})]
    env = worker_env()
    if supervised:  # tests/hooks/sitecustomize.py: the supervisor on CPU; no step goes above micro-batch 1000
        env["MEGACPP_TEST_OOM_ABOVE"] = "1000"
        env["PYTHONPATH"] = f"{ROOT / 'tests' / 'hooks'}{os.pathsep}{env['PYTHONPATH']}"
    agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 3):
            assert agent.poll() is None and time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.5)
        agent.kill()  # SIGKILL to torchrun's agent alone: its workers are orphaned
        agent.wait()
        while processes_mentioning(str(run_dir)):
            assert time.monotonic() < deadline + 60, "orphaned ranks went on training"
            time.sleep(0.5)
    finally:
        for pid in processes_mentioning(str(run_dir)):
            os.kill(pid, signal.SIGKILL)
    (ckpt,) = list_checkpoints(run_dir)
    step = verify_checkpoint(ckpt)["step"]
    trained = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
               if json.loads(line)["kind"] == "train"]
    assert 3 <= step < 500 and trained[-1] == step, "the step reached is saved, nothing trained after it is lost"
    with FileLock(run_dir / ".megacpp.lock", timeout=0):  # raises Timeout while a rank still holds the run
        pass
    outputs = {rank: "\n".join(p.read_text() for p in logs.rglob(f"attempt_*/{rank}/*.log")) for rank in (0, 1)}
    assert all("Traceback" not in out for out in outputs.values()), outputs
    saw_it = {rank: f"megacpp: rank {rank}: its launcher (torchrun's agent, pid {agent.pid}) is gone" in out
              for rank, out in outputs.items()}
    assert any(saw_it.values()), outputs
    # The first rank to see the agent gone stops as on SIGTERM, and the ranks agree on a stop with each step's
    # loss: a peer can stop at that step, and save, before its own once-a-second look at its parent.
    for rank, out in outputs.items():
        assert saw_it[rank] or f"interrupted at step {step}; saved checkpoint" in out, (rank, out[-3000:])
        # c10d logs each failed request to the dead store with a C++ stack trace: a supervisor that went on
        # asking every 0.2 s left eight of them in each rank's log; it asks no more after the first.
        assert out.count("Exception raised from") <= 2, (rank, out[-3000:])
