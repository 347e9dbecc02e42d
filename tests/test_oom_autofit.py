"""Out-of-memory auto-fit (issue 14): micro-batches that keep the token stream and the schedule, the
supervisor that retries a warmup OOM with half the micro-batch in a fresh process, its floor error, a
child's crash made visible, Ctrl-C through the supervisor, the micro-batch kept on --resume, and two
torchrun ranks retrying together when only one of them runs out of memory.

OOMs (MEGACPP_TEST_OOM_ABOVE, which also turns the supervisor on on CPU) and crashes
(MEGACPP_TEST_CRASH_AT_STEP) are injected by tests/hooks/sitecustomize.py, put first on PYTHONPATH by
`_hooked`. Every process is started under a wall-clock limit (tests/torchrun.py): a hang fails its test.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed
from safetensors.torch import load_file

from megacpp.cli import main
from megacpp.config import ConfigError
from megacpp.distributed import context
from megacpp.distributed.config import DistConfig
from megacpp.distributed.parity import relevant_env
from megacpp.presets import preset
from megacpp.run_config import load_config
from megacpp.runtime.checkpoint import list_checkpoints, verify_checkpoint
from megacpp.train.autofit.attempt import REPORT_ENV, OomReport, next_micro_batch
from megacpp.train.autofit.child_output import ChildOutput
from megacpp.train.autofit.rendezvous import oom_key
from megacpp.train.autofit.supervisor import (
    Fit,
    Job,
    PeerReports,
    _run_attempt,
    child_command,
    child_environment,
    next_fit,
)
from megacpp.train.loop import Trainer
from tests.helpers import tiny_train_args, tiny_train_config, write_corpus
from tests.torchrun import ROOT, Launch, python, torchrun, worker_env

HOOKS = ROOT / "tests" / "hooks"


def _quiet(_message: str) -> None:
    pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("oom") / "corpus"
    write_corpus(root)
    return root


def _losses(run_dir: Path) -> torch.Tensor:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return torch.tensor([r["loss"] for r in records if r["kind"] == "train"], dtype=torch.float64)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(list_checkpoints(run_dir)[0] / "model.safetensors"))


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _hooked(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the fault-injection hooks (tests/hooks/sitecustomize.py) first on PYTHONPATH."""
    return {**env, "PYTHONPATH": f"{HOOKS}{os.pathsep}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _cli(tmp_path: Path, corpus: Path, env: dict[str, str] | None = None, timeout: float = 300,
         extra: tuple[str, ...] = (), **overrides: str) -> Launch:
    """`python -m megacpp.cli train` on the tiny test model, batch 4 unless overridden; with ``env``
    (a hook's settings) the hooks are on PYTHONPATH."""
    return python(["-m", "megacpp.cli", *tiny_train_args(tmp_path, corpus, **overrides), *extra], timeout,
                  _hooked(env) if env else None)


# ---------------------------------------------------------------- micro-batch arithmetic and plumbing


def test_next_micro_batch_halves_through_divisors_of_the_batch_down_to_the_floor():
    assert next_micro_batch(64, 64, 1) == 32
    assert [next_micro_batch(12, m, 1) for m in (12, 6, 3)] == [6, 3, 1]  # 12 -> 6 -> 3 -> 1: divisors only
    assert next_micro_batch(12, 1, 1) is None  # nothing below the floor of 1
    assert next_micro_batch(12, 6, 4) is None  # 3 would be below a floor of 4
    assert next_micro_batch(10, 10, 1) == 5 and next_micro_batch(10, 5, 1) == 2  # 5 // 2 = 2 divides 10


def test_train_help_documents_the_autofit_switches(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "train.oom_autofit = true (the default)" in out
    assert "train.oom_min_micro_batch" in out and "train.micro_batch" in out


def test_a_micro_batch_that_does_not_divide_the_batch_is_a_config_error_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", None, [("train.batch_size", "6"), ("train.micro_batch", "4")])
    assert "command line --train.micro_batch: train.micro_batch = 4" in str(err.value)
    assert "train.batch_size = 6" in str(err.value)


def test_tier1_micro_batches_feed_the_same_rows_in_order_and_keep_the_schedule(tmp_path, small_corpus):
    """Micro-batch 2 of batch 4 (with grad_accum 2) runs, in order, exactly the rows, targets and
    document ids of the whole batches (torch.equal), and after two steps the loader position and the
    learning-rate schedule are the same: the token stream and the schedule do not depend on it."""
    seen: dict[int, list[tuple[torch.Tensor, ...]]] = {}
    trainers = {}
    for micro in (0, 2):  # 0: the whole batch of 4
        cfg = tiny_train_config(tmp_path / str(micro), small_corpus, **{
            "train.micro_batch": str(micro), "train.grad_accum": "2"})
        trainer = Trainer(cfg, log=_quiet, progress=False)
        inputs = seen[micro] = []
        trainer.model.register_forward_pre_hook(lambda _m, args, inputs=inputs: inputs.append(
            tuple(a.clone() for a in args)))
        for _ in range(2):
            trainer.train_step()
        trainers[micro] = trainer
    whole, split = seen[0], seen[2]
    assert len(whole) == 4 and len(split) == 8  # 2 steps x 2 accumulated batches, each in 2 micro-batches
    for i, batch in enumerate(whole):
        assert batch[0].shape[0] == 4 and split[2 * i][0].shape[0] == 2
        for part in range(3):  # inputs, targets, document ids
            assert torch.equal(torch.cat([split[2 * i][part], split[2 * i + 1][part]]), batch[part])
    assert trainers[0].data.loader.state_dict() == trainers[2].data.loader.state_dict()
    assert trainers[0].stack.scheduler.state_dict() == trainers[2].stack.scheduler.state_dict()


def test_a_retry_environment_lowers_distributed_debug_and_asks_for_nccl_error_handling(tmp_path):
    base = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    first = child_environment(base, 1, tmp_path / "r.json")
    assert first["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    retry = child_environment(base, 2, tmp_path / "r.json")
    assert retry["TORCH_DISTRIBUTED_DEBUG"] == "OFF" and retry["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert retry[REPORT_ENV] == str(tmp_path / "r.json")
    assert child_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, 2, tmp_path)[
        "TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the user's own setting stays


def test_a_retry_gets_its_micro_batch_last_on_its_command_line():
    """The supervisor's choice reaches the child through the configuration's own command line, after the
    user's arguments, so it wins over a --train.micro_batch the user gave (later overrides win)."""
    argv = ["train", "--train.micro_batch", "8"]
    assert child_command(argv, Fit())[-3:] == argv
    assert child_command(argv, Fit(2))[-5:] == [*argv, "--train.micro_batch", "2"]
    assert child_command(argv, Fit(2, recompute=True))[-7:] == [*argv, "--train.micro_batch", "2",
                                                                "--train.recompute", "all"]


def test_autofit_turns_recompute_on_before_the_micro_batch_drops_below_2():
    """Batch 8: 8 -> 4 -> 2 -> 2 with recompute -> 1 with recompute -> nothing left. With recompute
    already configured for every mixer it only halves; a floor of 2 still gets the recompute attempt."""
    tc = preset("tiny").train
    tc.batch_size, tc.oom_min_micro_batch, tc.recompute = 8, 1, "none"
    fits, fit, micro = [], Fit(), 8
    while (fit := next_fit(tc, fit, micro)) is not None:
        fits.append(fit)
        micro = fit.micro
    assert fits == [Fit(4), Fit(2), Fit(2, True), Fit(1, True)]
    tc.recompute = "all"
    assert next_fit(tc, Fit(), 2) == Fit(1) and next_fit(tc, Fit(1), 1) is None
    tc.recompute, tc.oom_min_micro_batch = "E", 2
    assert next_fit(tc, Fit(), 2) == Fit(2, True) and next_fit(tc, Fit(2, True), 2) is None


class _Stop(Exception):
    pass


@pytest.mark.parametrize("eager", [True, False])
def test_a_retry_forms_its_nccl_communicators_lazily_on_its_own_store(monkeypatch, eager):
    """On CUDA, device_id (eager NCCL init) is passed on a first attempt and not on a retry; the
    attempt's store is the one handed to init_process_group."""
    calls = []

    def init_process_group(**kwargs):
        calls.append(kwargs)
        raise _Stop

    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1", **context.FLIGHT_RECORDER}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(context, "rank_device", lambda *_: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda _device: None)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(context, "meet", lambda *_args: None)  # its peer never comes: only the group matters here
    store = torch.distributed.HashStore()
    with pytest.raises(_Stop):
        context.init_distributed("auto", DistConfig(), store=store, eager_nccl=eager)
    (call,) = calls
    assert call["device_id"] == (torch.device("cuda", 0) if eager else None)
    assert call["store"] is store and call["rank"] == 1 and call["world_size"] == 2


def test_parity_ignores_the_per_rank_autofit_variables():
    env = {REPORT_ENV: "/run/logs/attempt1.rank1.oom.json", "TORCHINDUCTOR_MAX_AUTOTUNE": "1", "PATH": "/bin"}
    assert relevant_env(env) == {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}


def test_child_output_streams_bytes_logs_finished_lines_and_keeps_a_tail(tmp_path):
    """The terminal gets every byte as written (progress redraws included); the log gets each line's
    last draw; the tail holds the last lines of both streams."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    sinks = (tmp_path / "stdout").open("w+b"), (tmp_path / "stderr").open("w+b")
    capture = ChildOutput((os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")), sinks, tmp_path / "logs" / "a.log",
                          "=== header")
    os.write(out_w, b"train: 10%\rtrain: 50%\rtrain: 100%\ndone\n")
    os.close(out_w)
    os.write(err_w, "Traceback\nRuntimeError: caf\xc3".encode("latin-1"))  # a cut-off UTF-8 sequence at the end
    os.close(err_w)
    capture.close()
    for sink in sinks:
        sink.seek(0)
    assert sinks[0].read() == b"train: 10%\rtrain: 50%\rtrain: 100%\ndone\n"
    log = (tmp_path / "logs" / "a.log").read_text().splitlines()
    assert log[0] == "=== header"
    assert sorted(log[1:]) == sorted(["train: 100%", "done", "Traceback", "RuntimeError: caf\ufffd"])
    assert sorted(capture.tail()) == sorted(log[1:])


def test_a_child_stopped_for_a_peers_out_of_memory_ends_its_log_saying_so(tmp_path, monkeypatch):
    """Under torchrun a rank whose child is blocked in a collective is stopped by its supervisor when a
    peer reports an out-of-memory error; that child's log must not just stop (seen on 2 H200s: rank 1's
    log ended with a warning). The "python" here is a stand-in that blocks."""
    blocker = tmp_path / "blocked-python"
    blocker.write_text("#!/bin/sh\nexec sleep 60\n")
    blocker.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(blocker))
    store = torch.distributed.HashStore()
    store.set(oom_key(1), OomReport(1, 64, 1, "peak 133.41 GiB", None, "CUDA out of memory").to_json())
    job = Job(rank=0, world_size=2, out_dir=tmp_path / "run")
    start = time.monotonic()
    outcome = _run_attempt(job, 1, Fit(), ["train"], store)
    assert time.monotonic() - start < 30 and outcome.oom is not None and outcome.oom.rank == 1
    assert job.log_path(1).read_text().splitlines()[-1] == (
        "=== stopped by the supervisor: rank 1 ran out of memory in warmup step 1 at micro-batch 64; every rank "
        "retries")


# ---------------------------------------------------------------- the supervisor, on CPU with the hook


@pytest.fixture(scope="module")
def retried_run(tmp_path_factory, corpus) -> tuple[Path, Launch]:
    """Batch 4 on a "GPU" that fits 2 rows: attempt 1 runs out of memory in step 1, attempt 2 trains."""
    tmp = tmp_path_factory.mktemp("retried")
    launch = _cli(tmp, corpus, env={"MEGACPP_TEST_OOM_ABOVE": "2"})
    return tmp / "run", launch.check()


@pytest.mark.slow
def test_tier1_a_retried_run_equals_a_run_started_at_the_smaller_micro_batch(tmp_path, corpus, retried_run):
    """Auto-fit's retry (micro-batch 4 -> 2) logs the same losses and ends with the same weights, bit for
    bit, as a run told to use micro-batch 2 from the start: nothing of the failed attempt leaks."""
    run_dir, launch = retried_run
    assert "megacpp: auto-fit: out of memory in warmup step 1 at micro-batch 4 (peak host RSS " in launch.output
    assert "attempt 2 runs micro-batch 2 x 2 per batch of 4" in launch.output
    _cli(tmp_path, corpus, **{"train.micro_batch": "2"}).check()
    assert torch.equal(_losses(run_dir), _losses(tmp_path / "run")) and len(_losses(run_dir)) == 6
    _assert_same_weights(_final_weights(run_dir), _final_weights(tmp_path / "run"))
    assert (run_dir / "logs" / "attempt1.log").is_file() and (run_dir / "logs" / "attempt2.log").is_file()
    report = json.loads((run_dir / "logs" / "attempt1.oom.json").read_text())
    assert report["micro_batch"] == 4 and report["step"] == 1 and report["peak_bytes"] > 0


@pytest.mark.slow
def test_the_micro_batch_is_recorded_and_resume_reuses_it(tmp_path, corpus, retried_run):
    """meta.json records auto-fit's micro-batch; --resume (no hook, so no supervisor) says it reuses it
    and does, although the command line says nothing about micro-batches."""
    run_dir, _ = retried_run
    assert all(verify_checkpoint(c)["micro_batch"] == 2 for c in list_checkpoints(run_dir))
    shutil.copytree(run_dir.parent, tmp_path / "copy")
    resumed = _cli(tmp_path / "copy", corpus, extra=("--resume",), **{"train.steps": "8"}).check()
    recorded = tmp_path / "copy" / "run" / "checkpoints" / "step_00000006" / "meta.json"
    assert f"resume: micro-batch 2 x 2 per batch of 4, as recorded in {recorded}" in resumed.output
    assert "batch 4 (as 2 micro-batches of 2)" in resumed.output
    assert verify_checkpoint(list_checkpoints(tmp_path / "copy" / "run")[0])["micro_batch"] == 2


@pytest.mark.slow
def test_out_of_memory_at_the_floor_is_one_line_naming_the_smallest_micro_batch_and_the_peak(tmp_path, corpus):
    launch = _cli(tmp_path, corpus, env={"MEGACPP_TEST_OOM_ABOVE": "0"}, **{"train.oom_min_micro_batch": "2"})
    assert launch.returncode == 1
    assert "Traceback" not in launch.output
    errors = [line for line in launch.output.splitlines() if line.startswith("megacpp: error:")]
    assert len(errors) == 1, launch.output[-3000:]
    assert errors[0].startswith("megacpp: error: out of memory in warmup at every micro-batch auto-fit tried "
                                "(4, 2, 2 with train.recompute all; train.oom_min_micro_batch = 2, train.batch_size "
                                "4): step 1 ran out with peak host RSS ")
    assert " GiB on cpu;" in errors[0]
    assert "attempt 2 runs micro-batch 2" in launch.output  # 4 was tried first
    assert not list_checkpoints(tmp_path / "run")


@pytest.mark.slow
def test_a_crashing_child_is_shown_with_its_tail_and_logged_in_the_run_directory(tmp_path, corpus):
    launch = _cli(tmp_path, corpus, env={"MEGACPP_TEST_OOM_ABOVE": "1000", "MEGACPP_TEST_CRASH_AT_STEP": "2"})
    assert launch.returncode == 1
    log = tmp_path / "run" / "logs" / "attempt1.log"
    header = (f"megacpp: error: the training process (attempt 1) failed (exit 1); the last 40 lines of its output "
              f"follow (all of it: {log})")
    assert header in launch.output
    tail = launch.output.split(header, 1)[1]
    assert "  | RuntimeError: injected crash in step 2" in tail
    assert "Traceback" in log.read_text() and "RuntimeError: injected crash in step 2" in log.read_text()
    assert "megacpp: auto-fit:" not in launch.output  # a crash is not retried


@pytest.mark.slow
def test_ctrl_c_on_the_supervisor_reaches_the_child_which_saves_and_exits_130(tmp_path, corpus):
    """SIGINT to the supervisor's pid alone (the child runs in its own session, so only forwarding can
    reach it): the child finishes its step, saves, prints how to resume; the supervisor exits 130."""
    args = tiny_train_args(tmp_path, corpus, **{"train.steps": "1000", "train.ckpt_every": "1000"})
    proc = subprocess.Popen([sys.executable, "-m", "megacpp.cli", *args], cwd=ROOT,
                            env=worker_env(_hooked({"MEGACPP_TEST_OOM_ABOVE": "1000"})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and '"kind": "train"' in metrics.read_text()):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no step logged in time"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, out[-3000:]
    (ckpt,) = list_checkpoints(tmp_path / "run")
    step = verify_checkpoint(ckpt)["step"]
    # Ctrl-C may land in a training step or in an evaluation (every 3 steps here), which it cuts short.
    assert re.search(rf"megacpp: interrupted (during the evaluation )?at step {step}; saved checkpoint "
                     rf"{re.escape(str(ckpt))}; continue with: megacpp train", out), out[-3000:]
    assert "Traceback" not in out and "failed" not in out


@pytest.mark.slow
def test_two_ranks_retry_together_when_only_rank_1_runs_out_of_memory(tmp_path, corpus):
    """torchrun, 2 gloo ranks, batch 2 per rank; rank 1 alone runs out of memory above micro-batch 1.
    Both supervisors retry together: attempt 2 keeps micro-batch 2 and recomputes every mixer (auto-fit
    turns recompute on before the micro-batch drops below 2), attempt 3 runs micro-batch 1 and trains to
    the end with the same losses (torch.equal) and weights as a 2-rank run started at micro-batch 1
    without recompute: recompute changes no bit."""
    overrides = {"train.batch_size": "2"}
    retried = torchrun(["-m", "megacpp.cli", *tiny_train_args(tmp_path / "retried", corpus, **overrides)],
                       timeout=400, env=_hooked({"MEGACPP_TEST_OOM_ABOVE": "1:1"})).check()
    said = [line for line in retried.output.splitlines()
            if "megacpp: auto-fit: out of memory in warmup step 1 on rank 1 at micro-batch 2" in line]
    assert len(said) == 4 and {s[:len("[default0]")] for s in said} == {"[default0]", "[default1]"}, retried.output
    assert sum("attempt 2 runs micro-batch 2 x 1 per batch of 2 with every mixer's activations recomputed" in s
               for s in said) == 2
    assert sum("attempt 3 runs micro-batch 1 x 2 per batch of 2 with every mixer's" in s for s in said) == 2
    assert "rank 0: out of memory" not in retried.output
    logs = tmp_path / "retried" / "run" / "logs"
    assert all((logs / f"attempt{a}.rank{r}.log").is_file() for a in (1, 2, 3) for r in (0, 1))
    # Rank 0's log ends saying why: its child's own line when a failed collective woke it first, else
    # the supervisor's when it had to stop a child blocked in a collective.
    assert "rank 1 ran out of memory in warmup step 1" in (logs / "attempt1.rank0.log").read_text().splitlines()[-1]
    assert "stopped by the supervisor" not in (logs / "attempt1.rank1.log").read_text()
    torchrun(["-m", "megacpp.cli", *tiny_train_args(tmp_path / "plain", corpus, **overrides,
                                                    **{"train.micro_batch": "1"})], timeout=400).check()
    assert torch.equal(_losses(tmp_path / "retried" / "run"), _losses(tmp_path / "plain" / "run"))
    _assert_same_weights(_final_weights(tmp_path / "retried" / "run"), _final_weights(tmp_path / "plain" / "run"))


class _Store:
    """A job store stand-in: `check` and `get` of one key, counted; `gone` makes every request fail as c10d's
    do once torchrun's agent, which hosts the store, was killed."""

    def __init__(self, values: dict[str, bytes], gone: bool = False) -> None:
        self.values, self.gone, self.requests = values, gone, 0

    def check(self, keys: list[str]) -> bool:
        self.requests += 1
        if self.gone:
            raise RuntimeError("recvValue failed: Connection was likely closed")
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        self.requests += 1
        return self.values[key]


def test_a_supervisor_reads_a_peers_report_and_stops_asking_a_store_that_is_gone():
    report = OomReport(rank=1, micro_batch=8, step=2, memory="79.1 of 80.0 GiB", peak_bytes=None, error="CUDA OOM")
    store = _Store({"megacpp/attempt3/oom": report.to_json().encode()})
    assert PeerReports(store, 3).get() == report
    assert PeerReports(_Store({}), 3).get() is None and PeerReports(None, 3).get() is None
    gone = _Store({}, gone=True)
    reports = PeerReports(gone, 3)
    assert reports.get() is None and reports.get() is None
    assert gone.requests == 1  # every failed request logs a C++ stack trace: asked once, not every POLL_S
