"""The optimizer step compiled by helper processes (megacpp.train.step_prewarm): the description of a call
round-trips, describes exactly the call the step then makes, and a helper's graphs are the step's (the
step's own compile then loads them from the cache)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch import nn

from megacpp.compile.config import CompileConfig
from megacpp.optim import OptimConfig, build_optimizers
from megacpp.optim.hparams import StepCall, TensorHParamOptimizer
from megacpp.train.step_prewarm import (
    StepPrewarm,
    TensorSpec,
    describe,
    helper_jobs,
    is_compiled,
    job_key,
    mark_compiled,
    materialize,
    skip_reason,
    spec_bytes,
)
from tests.distributed.step_calls import on_cpu
from tests.test_optim_standins import TinyHybrid, batch
from tests.torchrun import torchrun

REPO = Path(__file__).resolve().parents[1]


class Plan(NamedTuple):
    split: tuple[int, ...]
    scale: float


def test_description_round_trips_shapes_strides_identity_and_constants():
    shared = torch.ones(3, dtype=torch.float64)
    param = nn.Parameter(torch.randn(4, 6))
    transposed = torch.randn(6, 4).t()  # strides (1, 4)
    stand_in = torch.empty_strided((5, 2), (1, 5), dtype=torch.bfloat16, device="meta")
    plan = Plan((2, 3), 0.5)
    gathered = torch.randn(2, 5, 4)
    alias_a, alias_b = gathered[..., 3:].unbind(0)  # views of one storage: the graph sees aliases
    lone = torch.randn(10)[4:].view(2, 3)  # a view of its own, at offset 4
    value = ([param, transposed], (shared, stand_in, plan), [shared], 7, [alias_a, alias_b, lone])

    spec = describe(value)
    made = materialize(spec, torch.device("cpu"))

    (m_param, m_transposed), (m_shared, m_stand_in, m_plan), (m_shared_again,), number, views = made
    m_a, m_b, m_lone = views
    for original, copy in [(alias_a, m_a), (alias_b, m_b), (lone, m_lone)]:
        assert (copy.shape, copy.stride(), copy.storage_offset()) == (
            original.shape, original.stride(), original.storage_offset())
    assert (m_a.storage_offset(), m_b.storage_offset(), m_lone.storage_offset()) == (3, 23, 4)
    assert m_a.untyped_storage().data_ptr() == m_b.untyped_storage().data_ptr()
    assert m_a.untyped_storage().nbytes() == 2 * 5 * 4 * 4
    assert m_lone.untyped_storage().data_ptr() != m_a.untyped_storage().data_ptr()
    assert isinstance(m_param, nn.Parameter) and not isinstance(m_transposed, nn.Parameter)
    for original, copy in [(param, m_param), (transposed, m_transposed), (shared, m_shared)]:
        assert (copy.shape, copy.stride(), copy.dtype) == (original.shape, original.stride(), original.dtype)
        assert torch.equal(copy, torch.zeros_like(original))
    assert (m_stand_in.shape, m_stand_in.stride(), m_stand_in.dtype) == ((5, 2), (1, 5), torch.bfloat16)
    assert m_stand_in.device.type == "cpu"
    assert m_shared_again is m_shared  # one tensor in two places stays one tensor
    assert m_plan is plan and number == 7
    assert isinstance(spec[1][1], TensorSpec) and spec[1][1].device is None
    # param 24 x 4 B, transposed 24 x 4 B, shared 3 x 8 B once, the stand-in's extent 1 + 4 + 5 = 10 x 2 B,
    # the aliases' storage 40 x 4 B once, the lone view's offset and extent 4 + 6 x 4 B
    assert spec_bytes(spec) == 96 + 96 + 24 + 20 + 160 + 40


def test_first_step_calls_describe_the_calls_the_step_makes(monkeypatch):
    torch.manual_seed(0)
    model = TinyHybrid()
    stack = build_optimizers(model, OptimConfig(compile_step=True, grad_clip_norm=1.0), total_steps=4, log=None)
    calls = stack.first_step_calls()
    assert list(calls) == ["muon", "adamw"]
    promised = [StepCall(c.fn, on_cpu(describe(c.args)), c.backend) for made in calls.values() for c in made]

    made: list[StepCall] = []

    def record(self, fn, *args):  # the step's own calls, recorded instead of run
        made.append(StepCall(fn, describe(args), self.compile_backend))

    monkeypatch.setattr(TensorHParamOptimizer, "_run", record)
    idx, tgt = batch()
    model(idx, tgt).backward()
    stack.step()
    assert [c.fn.__name__ for c in made] == ["muon_step_part1", "muon_step_part2", "muon_step_part3", "muon_step_part4",
                                             "adamw_step"]
    assert made == promised


def test_tier1_skip_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    cpu = torch.device("cpu")
    jobs = helper_jobs({"muon": [StepCall(len, (torch.zeros(3),), "inductor")]}, cpu, False, CompileConfig())
    assert "compile.optimizer_helper is off" in skip_reason("off", jobs, cpu)
    assert "not compiled" in skip_reason("auto", {}, cpu)
    assert "CUDA only" in skip_reason("auto", jobs, cpu)
    assert skip_reason("on", jobs, cpu) is None
    assert skip_reason("on", jobs, cpu, retry=True) is None
    assert "auto-fit retry" in skip_reason("auto", jobs, cpu, retry=True)
    assert mark_compiled(jobs) is None
    assert "an earlier run put the step's graphs in the compile cache" in skip_reason("auto", jobs, cpu)
    assert skip_reason("on", jobs, cpu) is None  # on: the helpers run whatever the cache holds


def _job(shape=(4, 6), dtype=torch.float32, device="cpu", deterministic=False, **compile_settings):
    calls = {"muon": [StepCall(len, ([nn.Parameter(torch.randn(shape, dtype=dtype))], torch.ones(())), "inductor")]}
    return helper_jobs(calls, torch.device(device), deterministic, CompileConfig(**compile_settings))["muon"]


def test_tier1_an_optimizers_calls_are_shared_out_over_its_helpers_in_step_order():
    cpu = torch.device("cpu")
    tensors = [torch.zeros(1) for _ in range(10)]
    sizes = [1, 6, 2, 3]  # input tensors per call: shares {6} and {1, 2, 3}
    calls = {"muon": [StepCall(len, (tensors[:n],), "inductor") for n in sizes],
             "adamw": [StepCall(len, (tensors[:4],), "inductor")]}
    jobs = helper_jobs(calls, cpu, False, CompileConfig(), per_optimizer=2)
    assert list(jobs) == ["muon.1", "muon.2", "adamw"]
    assert [[len(c.args[0]) for c in jobs[name].calls] for name in jobs] == [[6], [1, 2, 3], [4]]
    three = helper_jobs(calls, cpu, False, CompileConfig(), per_optimizer=3)
    assert [[len(c.args[0]) for c in job.calls] for job in three.values()] == [[6], [3], [1, 2], [4]]
    one = helper_jobs(calls, cpu, False, CompileConfig(), per_optimizer=1)
    assert [[len(c.args[0]) for c in job.calls] for job in one.values()] == [sizes, [4]]


def test_tier1_job_key_follows_what_the_graphs_depend_on():
    key = job_key(_job())
    assert job_key(_job()) == key  # fresh tensors, same layouts
    assert job_key(_job(optimizer_helper="on", cache_dir="/elsewhere", import_cache="/warm")) == key
    changed = [_job(shape=(4, 7)), _job(dtype=torch.bfloat16), _job(device="meta"), _job(deterministic=True),
               _job(max_autotune=True), _job(mode="model")]
    keys = [job_key(job) for job in changed]
    assert key not in keys and len(set(keys)) == len(keys)


def test_tier1_compiled_marks_live_in_the_cache_directory(tmp_path, monkeypatch):
    first, other = tmp_path / "first", tmp_path / "other"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(first))
    jobs = {"muon": _job(), "adamw": _job(shape=(3, 3))}
    assert not any(is_compiled(job) for job in jobs.values())
    assert mark_compiled({"muon": jobs["muon"]}) is None
    assert is_compiled(jobs["muon"]) and not is_compiled(jobs["adamw"])
    assert is_compiled(_job())  # another run's description of the same step
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(other))
    assert not is_compiled(jobs["muon"])
    other.mkdir(exist_ok=True)
    (other / "megacpp-step-prewarm").write_text("a file where the marks' directory goes")
    assert "could not mark the step's graphs as compiled" in mark_compiled(jobs)


def planted_failure(x: torch.Tensor) -> torch.Tensor:
    raise ValueError("planted failure in the compiled call")


def test_a_failing_helper_is_reported_with_its_error_and_the_step_goes_on(tmp_path):
    calls = {"planted": [StepCall(planted_failure, (torch.zeros(3),), "eager")]}
    jobs = helper_jobs(calls, torch.device("cpu"), False, CompileConfig(cache_dir=str(tmp_path / "cache")))
    prewarm = StepPrewarm.start(jobs, tmp_path / "logs")
    line = prewarm.wait(timeout_s=300)
    assert "planted failed (exit 1: " in line and "ValueError('planted failure in the compiled call')" in line
    assert (tmp_path / "logs" / "optimizer_helper.planted.log").exists()
    assert prewarm.cache_line().startswith("optimizer step graphs from the helpers' cache:")


def _train(cache: Path, out: Path, helper: str) -> str:
    """One CPU step of `tiny` at depth 5 (each block kind once: the step's graphs keep every part and
    shrink with the parameter count, 130 -> 107 CPU-seconds for the cold run) through the CLI with the
    optimizer step compiled (the model eager); its log."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MEGACPP_CACHE_DIR=str(cache))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    command = [sys.executable, "-m", "megacpp.cli", "train", "--preset", "tiny", "--no-progress", "--train.steps", "1",
               "--train.sample_tokens", "4", "--train.out_dir", str(out), "--optim.compile_step", "true",
               "--model.depth", "5", "--compile.mode", "none", "--compile.optimizer_helper", helper]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=out.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_tier1_helpers_fill_the_cache_the_step_loads_and_a_warm_run_starts_none(tmp_path):
    """The trainer's helpers compile the graphs its first step then loads; the step marks them compiled, so
    the next run with that cache starts no helper (with the cache warm they only made the step wait)."""
    cache = tmp_path / "cache"
    cold = _train(cache, tmp_path / "cold", "on")
    muon_parts = "".join(rf"muon\.{i} \d+\.\d s \(1 call\), " for i in range(1, 5))
    assert re.search(rf"helper processes: {muon_parts}adamw \d+\.\d s \(1 call\)", cold), cold
    assert "optimizer step graphs from the helpers' cache: 5 of 5" in cold, cold  # Muon's four parts, AdamW
    assert len(list((cache / "inductor" / "megacpp-step-prewarm").iterdir())) == 5
    warm = _train(cache, tmp_path / "warm", "auto")
    assert "optimizer helper: none (an earlier run put the step's graphs in the compile cache)" in warm, warm
    assert "helper processes" not in warm and "helpers' cache" not in warm, warm


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_sharded_muon_describes_the_calls_its_step_makes(nproc):
    """Under fsdp a row-sharded matrix steps in three compiled calls around two exchanges; the helper
    compiles them from `first_step_calls`, whose layouts must be those the exchanges return."""
    launch = torchrun(["tests/distributed/step_calls.py"], nproc=nproc, timeout=240).check()
    assert launch.output.count("PASS") == nproc


@pytest.mark.slow
def test_sharded_step_loads_every_graph_from_the_helpers_cache(tmp_path):
    launch = torchrun(["tests/distributed/step_prewarm_hits.py", str(tmp_path / "cache"), str(tmp_path / "logs")],
                      nproc=2, timeout=900).check()
    found = re.findall(r"helpers' cache: (\d+) of (\d+) \((\d+) calls described\)", launch.output)
    assert len(found) == 2, launch.output[-3000:]
    for hits, graphs, calls in found:  # every call compiles one graph: each found in the cache
        assert hits == graphs == calls and int(calls) >= 5, found
