"""The loop's policies on their own: the frozen configuration, the batch plan, the auto-fit attempt's
warmup window, the stop votes of one process and the divergence guard."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch

from megacpp import validate
from megacpp.config import Config, ConfigError, to_dict
from megacpp.distributed.context import DistContext
from megacpp.distributed.stats import StatisticsReducer
from megacpp.presets import preset
from megacpp.run_config import from_dict, gate, load_config
from megacpp.section import FrozenSectionError, is_frozen
from megacpp.train import loop
from megacpp.train.autofit.attempt import WINDOW_STEPS, SupervisedAttempt
from megacpp.train.guards import DIVERGED_STEPS, DivergenceError, DivergenceGuard
from megacpp.train.plan import BatchPlan, trained_config
from megacpp.train.profile import StepProfiler, split_trace
from megacpp.train.votes import StopVotes
from tests.helpers import tiny_train_config


def test_the_gate_returns_a_frozen_copy_and_leaves_its_argument_alone():
    cfg = preset("tiny")
    gated = gate(cfg)
    assert is_frozen(gated) and is_frozen(gated.model.attention) and not is_frozen(cfg)
    with pytest.raises(FrozenSectionError, match=r"^AttentionConfig.n_heads: the configuration is frozen"):
        gated.model.attention.n_heads = 3
    with pytest.raises(FrozenSectionError, match=r"^TrainConfig.steps"):
        gated.train.steps = 1
    cfg.train.steps = 7  # the caller's own object stays a plain, mutable config
    assert cfg.train.steps == 7 and gated.train.steps == preset("tiny").train.steps
    assert gate(gated) is gated  # a frozen config has passed the gate: not checked or copied again


def test_a_loaded_or_saved_config_is_frozen_and_a_replaced_copy_is_not():
    cfg, _ = load_config("tiny", None, [("train.steps", "5")])
    assert is_frozen(cfg) and is_frozen(from_dict(to_dict(cfg)))
    changed = dataclasses.replace(cfg.train, steps=9)
    assert changed.steps == 9 and not is_frozen(changed) and cfg.train.steps == 5


def test_a_megacpp_train_runs_the_gate_once(tmp_path, small_corpus, monkeypatch):
    """load_config gates; the Trainer, handed the frozen result, does not gate again."""
    calls: list[int] = []
    original = validate.validate_config
    monkeypatch.setattr(validate, "validate_config", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    monkeypatch.setattr("megacpp.run_config.validate_config", validate.validate_config)
    from tests.helpers import tiny_overrides

    cfg, _ = load_config("tiny", None, list(tiny_overrides(tmp_path, small_corpus, **{"train.steps": "1"}).items()))
    assert len(calls) == 1
    loop.Trainer(cfg, log=lambda _line: None, progress=False).close()
    assert len(calls) == 1


def test_batch_plan_arithmetic():
    cfg = Config()
    cfg.train.batch_size, cfg.train.micro_batch, cfg.train.grad_accum, cfg.data.seq_len = 12, 4, 2, 100
    plan = BatchPlan.of(cfg, ranks=3)
    assert (plan.splits, plan.micro_steps, plan.global_batch) == (3, 6, 36)
    assert plan.tokens_per_step == 3 * 12 * 2 * 100
    assert plan.describe() == "batch 12 (as 3 micro-batches of 4) x 3 rank(s) x 2 accum x 100 tokens"
    cfg.train.micro_batch = 0  # the whole batch per forward
    whole = BatchPlan.of(cfg, ranks=1)
    assert whole.micro_batch == 12 and whole.splits == 1 and "micro-batches" not in whole.describe()
    assert whole.with_micro_batch(6).splits == 2


def test_tier1_the_plan_splits_a_batch_into_its_rows_in_order():
    cfg = Config()
    cfg.train.batch_size, cfg.train.micro_batch = 6, 2
    batch = tuple(torch.arange(6 * 5).reshape(6, 5) + k for k in range(3))
    pieces = BatchPlan.of(cfg, 1).split(batch)
    assert len(pieces) == 3
    for part in range(3):
        assert torch.equal(torch.cat([p[part] for p in pieces]), batch[part])
    cfg.train.micro_batch = 0
    assert BatchPlan.of(cfg, 1).split(batch)[0] is batch  # the default path hands the batch on untouched


def test_the_trained_config_carries_the_tokenizers_vocabulary_frozen():
    cfg = gate(preset("tiny"))
    trained = trained_config(cfg, 300)
    assert trained.model.vocab_size == 300 and is_frozen(trained) and cfg.model.vocab_size != 300
    assert to_dict(trained)["train"] == to_dict(cfg)["train"]


def test_the_supervised_attempts_warmup_window_closes_after_three_steps_or_a_checkpoint(tmp_path):
    attempt = SupervisedAttempt(1, tmp_path / "report.json", spawned=0.0)
    for _ in range(WINDOW_STEPS):
        attempt.step_started()
        assert attempt.in_window
    attempt.step_started()
    assert not attempt.in_window
    early = SupervisedAttempt(1, tmp_path / "report.json", spawned=0.0)
    early.step_started()
    early.checkpoint_published()
    assert not early.in_window
    # Outside the window a failure is not the attempt's to handle: it returns and the caller re-raises.
    assert attempt.on_failure(torch.OutOfMemoryError("x"), 0, 4, 5, torch.device("cpu")) is None
    assert not (tmp_path / "report.json").exists()


def _one_process() -> DistContext:
    return DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_stop_votes_of_one_process_read_its_own_clock_and_flag(monkeypatch):
    clock = iter([100.0, 101.0, 160.0])
    monkeypatch.setattr("megacpp.train.votes.time.perf_counter", lambda: next(clock))

    class Flag:
        requested = False

    votes = StopVotes(_one_process(), torch.device("cpu"), time_budget_s=70.0)
    votes.elapsed_before = 10.0
    votes.start(Flag())  # the clock starts at 100
    assert not votes.out_of_time()  # 10 + 1 s
    assert votes.out_of_time()  # 10 + 60 s: the budget of 70 is spent
    flag = votes.sigint
    assert not votes.interrupted_at_step_end() and not votes.interrupt_requested()
    flag.requested = True
    assert votes.interrupted_at_step_end() and votes.interrupt_requested()
    assert votes.queue({}) == {}  # one process votes with nobody: nothing to reduce


def test_the_divergence_guard_counts_consecutive_high_steps_only():
    cfg = Config()
    cfg.model.vocab_size = 100
    guard = DivergenceGuard(cfg.model)
    high = 1.6 * math.log(100)
    for step in range(1, DIVERGED_STEPS):  # one step short of the rule
        guard.check(step, high, 1.0)
    guard.check(DIVERGED_STEPS, 1.0, 1.0)  # one healthy step resets the count
    for step in range(10, 10 + DIVERGED_STEPS - 1):
        guard.check(step, high, 1.0)
    with pytest.raises(DivergenceError, match=rf"step 20: loss {high:.3f} above .* for {DIVERGED_STEPS} consecutive"):
        guard.check(20, high, 1.0)
    with pytest.raises(DivergenceError, match="step 21: the gradient norm is exactly 0"):
        guard.check(21, 1.0, 0.0)


def _kernel(name: str, start: float, end: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": end - start}


def test_a_profiled_window_splits_into_compute_exposed_collectives_and_idle():
    """Two steps in 1000 us: compute [0, 300) and [350, 700), an NCCL kernel [250, 450) half under compute,
    a memset [900, 950); CPU-side operators are not device time. Busy = [0, 700) + [900, 950) = 750 us.
    The host waited in two overlapping synchronizations [600, 800) and [700, 900) (200 + 200 us, 300 as
    a union); a kernel launch is host API time but not a wait."""
    host_api = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 600, "dur": 200},
                {"ph": "X", "cat": "cuda_driver", "name": "cuEventSynchronize", "ts": 700, "dur": 200},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 400}]
    events = [_kernel("gemm", 0, 300), _kernel("gemm", 350, 700), _kernel("ncclDevKernel_AllReduce", 250, 450),
              {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 900, "dur": 50}, *host_api,
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000}]
    split = split_trace(events, rank=1, first=3, last=4, wall_us=1000.0)
    assert (split.rank, split.first, split.last, split.kernels) == (1, 3, 4, 4)
    assert split.wall_ms == 0.5 and split.compute_ms == (300 + 350 + 50) / 2000
    assert split.collectives_ms == 200 / 2000 and split.exposed_collectives_ms == 50 / 2000
    assert split.idle_ms == 250 / 2000
    assert split.collectives_by_kind == {"AllReduce": 200 / 2000}
    assert split.host_wait_ms == 300 / 2000
    assert split.line() == ("profile, steps 3-4, rank 1: 0.5 ms per step = compute 0.3 (70%) + exposed "
                            "collectives 0.0 (5%) + idle 0.1 (25%); collectives 0.1 ms (AllReduce 0.1), "
                            "75% hidden under compute; the host waited for the device 0.1 ms")
    cpu = split_trace(events[-1:], rank=0, first=3, last=4, wall_us=1000.0)
    assert cpu.kernels == 0 and "no device kernels in the trace (a CPU run)" in cpu.line()


def test_tier1_the_profile_line_gives_each_optimizers_step_its_device_time():
    """Two steps: the main thread launches a forward kernel outside any range and, inside Muon's and then
    AdamW's step ranges, one kernel each; autograd's thread launches the backward's. Each kernel is found by
    its launch's correlation id; only what an optimizer's step launched goes to the line's last clause."""
    def launch(tid, ts, correlation):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "pid": 0,
                "tid": tid, "args": {"correlation": correlation}}

    def kernel(name, ts, dur, correlation):
        return {**_kernel(name, ts, ts + dur), "pid": 1, "tid": 7, "args": {"correlation": correlation}}

    def step_range(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": f"Optimizer.step#{name}.step", "ts": ts, "dur": dur, "pid": 0,
                "tid": 1}

    events = [launch(1, 0, 1), launch(2, 5, 2), launch(1, 50, 3), launch(1, 70, 4),
              step_range("Muon", 40, 20), step_range("AdamW", 65, 10),
              kernel("forward", 0, 300, 1), kernel("backward", 300, 500, 2), kernel("ns", 800, 140, 3),
              kernel("adam", 940, 40, 4)]
    split = split_trace(events, rank=0, first=3, last=4, wall_us=1000.0)
    assert split.optimizer_ms == {"Muon.step": 0.07, "AdamW.step": 0.02}
    assert split.line().endswith("; optimizer steps: Muon 0.1 ms, AdamW 0.0 ms")


def test_the_profiled_window_starts_at_step_10_where_the_run_allows():
    def window(steps, total):
        profiler = StepProfiler(steps, total, Path("run"), _one_process(), print)
        return profiler.first, profiler.last

    assert window(3, 100) == (10, 12)
    assert window(2, 5) == (4, 5)  # as late as a short run allows
    with pytest.raises(ConfigError, match=r"train.profile_steps = 2: profiling 2 step\(s\) after the 2 warmup steps "
                                          r"needs train.steps >= 4"):
        load_config("tiny", None, [("train.profile_steps", "2"), ("train.steps", "3")])


def test_train_profile_from_picks_the_window_and_refuses_one_the_run_cannot_reach():
    assert StepProfiler(3, 100, Path("run"), _one_process(), print, start=40).first == 40
    assert StepProfiler(3, 100, Path("run"), _one_process(), print, start=40).last == 42
    settings = [("train.profile_steps", "3"), ("train.profile_from", "20"), ("train.steps", "22")]
    cfg, _ = load_config("tiny", None, settings)
    assert (cfg.train.profile_from, cfg.train.profile_steps) == (20, 3)
    with pytest.raises(ConfigError, match=r"train.profile_from = 2 must be 0 \(automatic\) or at least 3: steps 1 "):
        load_config("tiny", None, [("train.profile_steps", "1"), ("train.profile_from", "2")])
    with pytest.raises(ConfigError, match=r"profiling steps 20-22 needs train.steps >= 22"):
        load_config("tiny", None, [("train.profile_steps", "3"), ("train.profile_from", "20"), ("train.steps", "21")])


def test_tier1_a_profile_asks_kineto_to_detach_cupti_when_it_ends_unless_the_user_chose(monkeypatch, tmp_path):
    """CUPTI left attached slowed every later step of `small` by about 10% (BENCHMARKS A8)."""
    monkeypatch.setenv("TEARDOWN_CUPTI", "")  # records the variable's state before the test, to restore it
    monkeypatch.delenv("TEARDOWN_CUPTI")
    idle = StepProfiler(0, 100, tmp_path, _one_process(), print)
    for step in range(1, 20):
        idle.before_step(step)
    assert "TEARDOWN_CUPTI" not in os.environ  # no profile, nothing set
    profiler = StepProfiler(2, 100, tmp_path, _one_process(), print)
    profiler.before_step(9)
    assert "TEARDOWN_CUPTI" not in os.environ  # set as the profile starts, not before
    profiler.before_step(10)
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    profiler.after_step(10, None)
    assert profiler.after_step(11, None).first == 10 and profiler._profiler is None

    class Profile:  # stands in for torch.profiler.profile where no GPU is
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.profiler, "profile", Profile)
    lines: list[str] = []
    on_gpu = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    StepProfiler(2, 100, tmp_path, on_gpu, lines.append).before_step(10)
    assert os.environ["TEARDOWN_CUPTI"] == "0"
    assert lines == ["TEARDOWN_CUPTI=0 is set: CUPTI stays attached after the profile, and the steps after it run "
                     "slower (about 10% on `small`); unset it to keep their speed"]


def test_train_profile_steps_writes_a_trace_and_a_split_per_rank(tmp_path, small_corpus):
    from megacpp.train.metrics import read_metrics
    from tests.helpers import tiny_train_config

    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "5", "train.profile_steps": "2"})
    lines: list[str] = []
    loop.Trainer(cfg, log=lines.append, progress=False).run()
    assert any(line.startswith("profile, steps 4-5, rank 0: ") for line in lines)
    assert (tmp_path / "run" / "profile" / "rank0.trace.json").stat().st_size > 0
    (record,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "profile"]
    assert record["step"] == 5 and record["rank0"]["first"] == 4 and record["rank0"]["wall_ms"] > 0


def test_tier1_a_steps_statistics_cover_its_whole_batch(tmp_path, small_corpus):
    """Batch 4 run as micro-batches of 2: the MoE expert counts (sum) and the attention logit bounds
    (max) after the step equal those of the batch run whole, bitwise, and the counts hold every routed
    token of the batch (before, they held the last micro-batch's half); so does the selection bias the
    counts moved."""
    overrides = {"model.attention.qk_clip": "weight", "model.attention.qk_norm": "false", "train.steps": "2"}
    stats = {}
    for micro in ("0", "2"):
        cfg = tiny_train_config(tmp_path / micro, small_corpus, **{**overrides, "train.micro_batch": micro})
        trainer = loop.Trainer(cfg, log=lambda _line: None, progress=False)
        trainer.train_step()
        moe = [b.mixer for b in trainer.model.blocks if b.kind == "E"]
        attention = [b.mixer for b in trainer.model.blocks if b.kind == "A"]
        stats[micro] = ([m.tokens_per_expert.clone() for m in moe], [m.expert_bias.clone() for m in moe],
                        [a.logit_bound.clone() for a in attention])
        routed = 4 * cfg.data.seq_len * cfg.model.moe.top_k
        assert all(int(m.tokens_per_expert.sum()) == routed for m in moe)
        trainer.close()
    for whole, split in zip(stats["0"], stats["2"], strict=True):
        assert len(whole) > 0 and all(torch.equal(a, b) for a, b in zip(whole, split, strict=True))


def test_statistics_fold_by_their_declared_reduction():
    class Stats(torch.nn.Module):
        reduced_buffers = {"count": "sum", "bound": "max"}

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(2, dtype=torch.long), persistent=False)
            self.register_buffer("bound", torch.zeros(3), persistent=False)

    module = Stats()
    reducer = StatisticsReducer(module, _one_process())
    reducer.begin_step(3)
    for count, bound in (([1, 2], [0.5, 4.0, 1.0]), ([3, 0], [2.0, 1.0, 1.5]), ([0, 5], [1.0, 3.0, 0.25])):
        module.count.copy_(torch.tensor(count))
        module.bound.copy_(torch.tensor(bound))
        reducer.after_forward()
    reducer()
    assert module.count.tolist() == [4, 7] and module.bound.tolist() == [2.0, 4.0, 1.5]
    reducer.begin_step(2)
    reducer.after_forward()
    with pytest.raises(RuntimeError, match="statistics of 1 forward"):
        reducer()


def test_the_gate_refuses_an_autofit_floor_above_the_batch():
    with pytest.raises(ConfigError, match=r"train.oom_min_micro_batch = 8: the smallest micro-batch auto-fit may "
                                          r"try is larger than the batch it splits; train.batch_size = 4"):
        load_config("tiny", None, [("train.batch_size", "4"), ("train.oom_min_micro_batch", "8")])


def test_the_weights_in_doubt_reach_back_over_losses_already_above_the_divergence_level():
    """Step i + 1's loss is computed from the weights after step i: a fault implicating the weights after
    step 5 implicates those after step 3 too when steps 4 and 5 already lost above the level."""
    cfg = Config()
    cfg.model.vocab_size = 100
    guard = DivergenceGuard(cfg.model)
    high, low = 1.6 * math.log(100), 1.4 * math.log(100)
    losses = [low, low, low, high, high]  # steps 1..5
    assert guard.implicated_from(losses, 5) == 3
    assert guard.implicated_from(losses, 3) == 3
    assert guard.implicated_from([high, high], 2) == 0  # from the initial weights on
