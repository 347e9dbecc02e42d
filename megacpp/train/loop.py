"""The training loop: the run's plot. Data, model and optimizers are built, then each step trains,
records, evaluates, checkpoints and votes on stopping, and the run ends with a plot and a sample.

One loop for one process and for every rank of a torchrun job. The `DistContext` makes collectives
no-ops on one process; under torchrun the model is replicated or sharded (the `DataParallel` of
megacpp.distributed.strategy), every per-rank statistic is reduced, ranks are checked for parity at
start, after warmup and periodically, and a watchdog ends a stalled job. Only rank 0 writes metrics, plots and samples.
What the loop calls, each in a module of its own under train/: guards (non-finite loss and weights,
divergence), lifecycle (run directory, resume, save), records (the per-step metrics), votes (Ctrl-C
and the time budget), plan (the batch arithmetic and the trained configuration) and autofit (the
attempt this process is).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from megacpp.compile.cudagraphs import begin_graph_step, decide_cudagraphs, skipped_line
from megacpp.compile.entry import prepare_compile
from megacpp.compile.health import CompileHealth, bounds_for, forbid_recompiles
from megacpp.compile.workers import start_compile_workers
from megacpp.config import Config, dump_toml, to_dict
from megacpp.distributed.context import DistContext
from megacpp.distributed.health import check_compile_health
from megacpp.distributed.logs import RankLog
from megacpp.distributed.parity import (
    check_parity,
    dynamo_policy,
    library_versions,
    model_layout,
    relevant_env,
    replica_fingerprint,
    shared_config,
    weight_fingerprint,
)
from megacpp.distributed.stats import StatisticsReducer
from megacpp.distributed.strategy import apply_data_parallel
from megacpp.distributed.watchdog import StepWatchdog
from megacpp.model.hints import collect_param_hints, run_after_optimizer_step
from megacpp.model.params import flops_per_token, parameter_table
from megacpp.ops import kernel_prewarm
from megacpp.ops.fast_paths import kernel_report
from megacpp.optim import build_optimizers
from megacpp.optim.groups import format_routing_table, optimizer_state_bytes, route_parameters
from megacpp.run_config import gate
from megacpp.runtime.checkpoint import checkpoint_root, list_checkpoints
from megacpp.runtime.data import build_data
from megacpp.runtime.device import autocast_context, peak_flops
from megacpp.runtime.evaluate import evaluate_bpb
from megacpp.runtime.model_build import build_model
from megacpp.runtime.model_size import check_model_fits
from megacpp.train.autofit.attempt import Attempt
from megacpp.train.config import recompute_kinds
from megacpp.train.determinism import configure_mode, rng_state, seed_everything, set_rng_state
from megacpp.train.finetune import fine_tuning_config, load_initial_weights
from megacpp.train.grad_norms import PartGradNorms, spike_summary
from megacpp.train.guards import DivergenceGuard, TrainingFault, check_finite_weights, stop_nonfinite_loss
from megacpp.train.interrupt import StopRequest
from megacpp.train.lifecycle import RunDirectory
from megacpp.train.metrics import MetricsLogger, plot_loss
from megacpp.train.model_prewarm import ModelPrewarm, model_jobs
from megacpp.train.model_prewarm import skip_reason as model_skip_reason
from megacpp.train.phase_clock import PhaseClock
from megacpp.train.plan import BatchPlan, resumed_plan, trained_config
from megacpp.train.profile import StepProfiler
from megacpp.train.readback import Readback
from megacpp.train.recompute import apply_recompute
from megacpp.train.records import StepRecords
from megacpp.train.report import TrainResult, interruption
from megacpp.train.rundir import start_over
from megacpp.train.sample import end_of_run_sample
from megacpp.train.step_prewarm import (
    HelperJob,
    StepPrewarm,
    fx_cache_counts,
    helper_jobs,
    is_compiled,
    mark_compiled,
    skip_reason,
)
from megacpp.train.votes import StopVotes
from megacpp.versions import torch_version


class Trainer:
    def __init__(self, cfg: Config, log=print, progress: bool = True, ctx: DistContext | None = None,
                 resume: bool | None = None, attempt: Attempt | None = None) -> None:
        """`resume` given here claims the run directory before any data or model work (the CLI does);
        left None, `run` claims it. `attempt`: this process's place in auto-fit (a supervised child does
        not claim the run directory: its supervisor holds it for every attempt)."""
        # A Config from load_config passed the gate and is frozen; one built in Python meets it here,
        # before minutes of corpus and tokenizer work.
        self.cfg = gate(cfg)
        # Fine-tuning takes the checkpoint's model settings and tokenizer (megacpp.train.finetune).
        self.cfg, self.init_from = fine_tuning_config(self.cfg, log) if self.cfg.train.init_from else (self.cfg, None)
        tc = self.cfg.train
        self.mode = configure_mode(tc.deterministic)
        # env and Dynamo policy: before any compile or process group
        self.compile_status = prepare_compile(self.cfg.compile, process_group_timeout_s=self.cfg.dist.init_timeout_s)
        self.attempt = attempt or Attempt()
        self.ctx = ctx or self.attempt.init_distributed(tc.device, self.cfg.dist, tc.out_dir)
        self.log = log
        self.run_dir = RunDirectory(self.cfg, self.ctx, log)
        self.claimed = not self.attempt.claims_run_dir
        try:
            if resume is not None and not self.claimed:
                self._claim(resume)
            if resume:  # before the data work, which can take minutes: an incompatible resume stops here
                self.run_dir.check_resume_settings()
            self._build(log, progress)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _build(self, log, progress: bool) -> None:
        tc, ctx = self.cfg.train, self.ctx
        self.device = ctx.device
        start_compile_workers(self.cfg.compile, self.device)  # up by the first compile, after the data and model
        self.phase_clock = PhaseClock(self.device)  # the first step's phases, then off
        self.out_dir = Path(tc.out_dir)
        self.log = RankLog(self.out_dir, ctx.rank, log if ctx.is_main else None) if ctx.distributed else log
        self.run_dir.log = self.log
        self.progress = progress and ctx.is_main
        seed_everything(tc.seed)
        # `compile.cudagraphs on` where graphs cannot run is refused here, before the data work (the config gate
        # cannot know what device auto resolves to); compile_model decides again, from the same inputs.
        decide_cudagraphs(self.cfg.compile, self.device)
        # Before the data (which may take minutes): the tokenizer's vocabulary is data.vocab_size.
        check_model_fits(trained_config(self.cfg, self.cfg.data.vocab_size).model, self.device)
        # A validation batch is an optimizer step's rows, so `train.eval_batches` covers the same text on any
        # number of GPUs that keeps them (a resume on 2 GPUs x 2 accumulated of a run on 4).
        self.data = build_data(self.cfg.data, tc.seed, tc.batch_size, self.device, self.log, self.progress,
                               rank=ctx.rank, world_size=ctx.world_size, val_batch_size=tc.batch_size * tc.grad_accum)
        self.cfg = trained_config(self.cfg, self.data.tokenizer.vocab_size)
        self.batch = BatchPlan.of(self.cfg, ctx.world_size)
        torch.manual_seed(tc.seed)  # model init draws from a fixed point, whatever the data step drew
        self.model = build_model(self.cfg.model, self.device)  # its weights drawn on the device
        if self.init_from is not None:
            load_initial_weights(self.model, self.init_from)
        # Counted before anything is sharded: the whole model's parameters and compute per token.
        self.parameter_table = parameter_table(self.model)
        self.flops_per_token = flops_per_token(self.model, self.cfg.data.seq_len)
        # Fingerprinted before sharding (the whole weights); only a job of several ranks compares it.
        initial_weights = weight_fingerprint(self.model) if ctx.distributed else None
        hints = collect_param_hints(self.model)  # by name, before FSDP2 replaces the parameters
        # The optimizers' groups over the whole model (expert parallelism leaves each rank its own rows).
        self.routing_table = format_routing_table(route_parameters(self.model, self.cfg.optim, hints), self.cfg.optim)
        self.health = CompileHealth(bounds_for(self.cfg.compile), report=self.log)
        apply_recompute(self.model, recompute_kinds(tc.recompute))  # before compile: the regions trace it
        self.parallel = apply_data_parallel(
            self.model, self.cfg.compile, self.cfg.dist, ctx,
            state_bytes=lambda: optimizer_state_bytes(self.model, self.cfg.optim, hints),
            ns_steps=self.cfg.optim.ns_steps, expert_ns_steps=self.cfg.optim.routed_expert_ns_steps)
        self.health.attach(self.parallel.compiled)
        self.stack = build_optimizers(self.model, self.cfg.optim, total_steps=tc.steps, log=None, hints=hints,
                                      classes=self.parallel.optimizer_classes,
                                      model_compiled=self.cfg.compile.mode != "none",
                                      owns=self.parallel.owns if self.parallel.shards_optimizer_by_owner else None,
                                      after_optimizers=self.parallel.after_optimizers,
                                      grad_norm=self.parallel.grad_norm)
        self.step_jobs: dict[str, HelperJob] = {}  # marked compiled after the first optimizer step
        self.step_prewarm, self.step_prewarm_note = self._start_step_prewarm()
        self.model_prewarm, self.model_prewarm_note = self._start_model_prewarm()
        self.model_cache_counts: tuple[int, int] | None = None  # the first forward and backward's FX cache
        self.reduce_statistics = StatisticsReducer(self.model, ctx)
        self.part_grad_norms = PartGradNorms(self.model, ctx, self.parallel.experts)
        self.grad_norms: dict[str, Tensor] = {}  # the last step's, per part, logged with its record
        self.block_grad_norms: Tensor | None = None  # the last step's, per block
        self.votes = StopVotes(ctx, self.device, tc.time_budget_s)
        self.step = 0
        self.losses: list[float] = []
        self.guard = DivergenceGuard(self.cfg.model)
        if ctx.distributed:  # one process has nobody to compare with: build nothing
            check_parity(ctx, {
                "config": shared_config(to_dict(self.cfg)), "versions": library_versions(self.device),
                "determinism": self.mode, "dynamo_policy": dynamo_policy(), "environment": relevant_env(),
                "kernels": kernel_report(), "tokenizer": self.data.tokenizer_hash, "data": self.data.shards.key,
                "global_batch": self.batch.global_batch, "data_parallel": self.parallel.name,
                "parameters": model_layout(self.model),
                "initial_weights": initial_weights,
            }, "at start")

    def close(self, orderly: bool = False) -> None:
        """Release the run directory and leave the process group (every exit path: a live group keeps
        peers waiting); ``orderly`` at the end of a run that every rank finished."""
        self.run_dir.release()
        if getattr(self, "step_prewarm", None) is not None:  # the run ended before its first optimizer step
            self.step_prewarm.stop()
        if getattr(self, "model_prewarm", None) is not None:
            self.model_prewarm.stop()
        if hasattr(self, "parallel"):  # built once the model is
            self.parallel.close()
        self.ctx.close(orderly)

    def _start_step_prewarm(self) -> tuple[StepPrewarm | None, str]:
        """The helper processes that compile the optimizer step while the model compiles, if they start;
        and the run header's note on them."""
        setting = self.cfg.compile.optimizer_helper
        if setting != "off":
            self.step_jobs = helper_jobs(self.stack.first_step_calls(), self.device, self.cfg.train.deterministic,
                                         self.cfg.compile)
        reason = skip_reason(setting, self.step_jobs, self.device, retry=self.attempt.is_retry)
        if reason is not None:
            return None, f"optimizer helper: none ({reason})"
        jobs = {name: job for name, job in self.step_jobs.items() if setting == "on" or not is_compiled(job)}
        suffix = f".rank{self.ctx.rank}" if self.ctx.distributed else ""
        prewarm = StepPrewarm.start(jobs, self.out_dir / "logs", suffix)
        named = ", ".join(f"{name}'s {len(job.calls)} call{'s' * (len(job.calls) != 1)}" for name, job in jobs.items())
        return prewarm, (f"optimizer helper: compiling {named} beside the model "
                         f"(logs: {self.out_dir / 'logs'}/optimizer_helper.*)")

    def _start_model_prewarm(self) -> tuple[ModelPrewarm | None, str]:
        """The helper processes that compile the model's block kinds beside the trainer, when
        compile.model_helper is on and the run can use them; and the run header's line on them."""
        cfg = self.cfg
        if cfg.compile.model_helper == "off":
            return None, ""
        why_not = model_skip_reason(cfg.compile, self.parallel.name, cfg.dist.expert_parallel, self.attempt.is_retry,
                                    self.ctx.local_rank)
        if why_not is not None:
            return None, f"model helper: none ({why_not})"
        # The helpers replay as the trainer does (Inductor keys its cache by that setting), decided here: a
        # lone helper would choose replay where a replicate trainer does not.
        replay = "on" if self.parallel.compiled.cudagraphs else "off"
        jobs = model_jobs(self.model, dataclasses.replace(cfg.compile, cudagraphs=replay), cfg.train.deterministic,
                          cfg.train.recompute, self.device, self.batch.micro_batch, cfg.data.seq_len)
        suffix = f".rank{self.ctx.rank}" if self.ctx.distributed else ""
        prewarm = ModelPrewarm.start(jobs, self.out_dir / "logs", suffix)
        prewarm.attach(self.model.blocks)  # the first forward waits for each kind's graph instead of racing it
        return prewarm, f"model helper: compiling {', '.join(jobs)} beside the trainer (logs: model_helper.*)"

    def _claim(self, resume: bool) -> None:
        self.run_dir.claim(resume)
        self.claimed = True

    def _fail(self, exc: BaseException) -> None:
        """Put a rank's failure in its own log file (torchrun shows only the first failing rank)."""
        if self.ctx.distributed and isinstance(self.log, RankLog):
            self.log.record(f"failed: {type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}")
        self.close()

    # ---------------------------------------------------------------- state

    def meta(self) -> dict[str, Any]:
        return {"config": to_dict(self.cfg), "tokenizer_hash": self.data.tokenizer_hash,
                "determinism": self.mode, "torch": str(torch_version()), "world_size": self.ctx.world_size,
                "global_batch": self.batch.global_batch, "micro_batch": self.batch.micro_batch}

    def save(self) -> Path:
        self.parallel.settle()
        check_finite_weights(self.ctx, self.model, self.step, self.out_dir)
        state = {"step": self.step, "optim": self.stack.state_dict(), "loader": self.data.loader.state_dict(),
                 "rng": rng_state(self.device), "losses": torch.tensor(self.losses, dtype=torch.float64),
                 "elapsed_s": self.votes.elapsed()}
        in_doubt_from = self.guard.implicated_from(self.losses, self.step)
        path = self.run_dir.save(self.step, self.model, self.stack.moments(), state, self.meta(),
                                 self.data.tokenizer_json, in_doubt_from=in_doubt_from, experts=self.parallel.experts)
        self.attempt.checkpoint_published()
        return path

    def resume(self) -> Path | None:
        path = self.run_dir.resume_checkpoint()
        if path is None:
            broken = len(list_checkpoints(self.out_dir))  # each was named as skipped while looking
            found = f"none of the {broken} checkpoints verifies" if broken else "no checkpoint"
            restart = start_over(self.out_dir) if self.ctx.is_main else "starting from step 0"
            self.log(f"--resume: {found} under {checkpoint_root(self.out_dir)}; {restart}")
            return None
        state, meta = self.run_dir.restore(path, to_dict(self.cfg.model), self.data.tokenizer_hash, self.model,
                                           self.stack.moments(), self.parallel.experts)
        self.stack.load_state_dict(state["optim"])
        self.run_dir.extend_schedule(meta, self.stack.scheduler, int(state["step"]))
        self.data.loader.load_state_dict(state["loader"], self.run_dir.loader_may_change_batch(meta))
        set_rng_state(state["rng"], self.device)
        self.step = int(state["step"])
        self.losses = state["losses"].tolist()
        self.batch = resumed_plan(self.batch, self.cfg.train.micro_batch, meta.get("micro_batch"), path, self.log)
        self.votes.elapsed_before = float(state.get("elapsed_s", 0.0))  # checkpoints before issue 13 lack it
        check_parity(self.ctx, {"checkpoint": str(path), "step": self.step,
                                "loader": self.data.loader.state_dict()}, "after resume")
        self.log(f"resumed from {path} at step {self.step}")
        return path

    # ---------------------------------------------------------------- the run

    def run(self, resume: bool = False) -> TrainResult:
        try:
            if not self.claimed:
                self._claim(resume)
            result = self._run(resume)
        except BaseException as exc:
            self._fail(exc)
            raise
        self.close(orderly=True)
        return result

    def _run(self, resume: bool) -> TrainResult:
        cfg, tc, ctx = self.cfg, self.cfg.train, self.ctx
        self.run_dir.check_shared()
        if resume:  # before anything in out_dir is written: an incompatible resume changes nothing
            self.resume()
        if self.step >= tc.steps or (tc.time_budget_s and self.votes.elapsed_before >= tc.time_budget_s):
            return self._nothing_to_train()
        if ctx.is_main:
            (self.out_dir / "config.toml").write_text(dump_toml(cfg))
        self.log(self.run_header())
        metrics = MetricsLogger(self.out_dir, tc.tensorboard, resume=resume) if ctx.is_main else None
        if metrics is not None:  # the figures the plot and compare_quality.py draw beside val bits/byte
            metrics.log(self.step, "baselines", self.data.baselines.record())
        bar = tqdm(total=tc.steps, initial=self.step, disable=not self.progress, dynamic_ncols=True,
                   desc="train", unit="step")
        records = StepRecords(metrics, bar, self.part_grad_norms, self.guard,
                              tc.log_every, self.flops_per_token, peak_flops(self.device))
        watchdog = StepWatchdog(self.out_dir / "logs", ctx.rank) if ctx.distributed else None
        after_warmup = contextlib.ExitStack()
        compile_record: dict[str, Any] = {}
        out_of_time = False
        checkpoint: Path | None = None
        self.votes.start(after_warmup.enter_context(StopRequest()))
        profiler = StepProfiler(tc.profile_steps, tc.steps, self.out_dir, ctx, self.log, tc.profile_from)
        try:
            t_last = time.perf_counter()
            while self.step < tc.steps:
                self._expect_progress(watchdog, f"step {self.step + 1}")
                self.attempt.step_started()
                profiler.before_step(self.step + 1)
                loss = self.train_step()
                self.step += 1
                profiler.after_step(self.step, metrics)
                if not self.health.warm:  # every compiled region has run once: a recompile is a regression now
                    compile_record = self._end_warmup(after_warmup)
                    compile_record["first_step_phases_s"] = self.phase_clock.stop()
                    if self.phase_clock.peak_gib:
                        compile_record["first_step_peak_gib"] = dict(self.phase_clock.peak_gib)
                    self.log(self.phase_clock.line("first step") + f"; {self.health.slowest()}")
                    if (line := self.attempt.first_step_line(self.batch.micro_batch)) is not None:
                        self.log(line)
                    if self.model_prewarm is not None:
                        self.log(self._model_prewarm_line())
                    if (line := kernel_prewarm.outcomes()) is not None:
                        self.log(line)
                    if self.parallel.compiled.cudagraphs and (line := skipped_line()) is not None:
                        self.log(line)
                self.losses.append(loss)
                out_of_time = self.step < tc.steps and self.votes.out_of_time()  # same step on every rank
                final = self.step == tc.steps or out_of_time  # log, evaluate and save the last step
                now = time.perf_counter()
                self._record_step(records, loss, self.batch.tokens_per_step / max(now - t_last, 1e-9), final)
                t_last = now
                checkpoint_due = self.step % tc.ckpt_every == 0 or final
                evaluation_due = self.step % tc.eval_every == 0 or final
                if evaluation_due or checkpoint_due:  # both wait for the device anyway: this step's record now
                    records.flush()
                if evaluation_due:
                    self._evaluate(records, watchdog)
                if checkpoint_due or (cfg.dist.fingerprint_every and self.step % cfg.dist.fingerprint_every == 0):
                    self._check_replicas()
                if checkpoint_due:
                    self._expect_progress(watchdog, f"checkpoint at step {self.step}")
                    checkpoint = self.save()
                if evaluation_due or checkpoint_due:  # the next step's tok/s is its own, without these
                    t_last = time.perf_counter()
                if self.votes.interrupted_at_step_end():
                    self._stop_interrupted(watchdog, checkpoint if checkpoint_due else None)
                if out_of_time:
                    self.log(f"time budget of {tc.time_budget_s:g} s spent at step {self.step} "
                             f"({self.votes.elapsed():.0f} s): evaluated and saved; stopping before train.steps "
                             f"{tc.steps}")
                    break
            self._expect_progress(watchdog, "the final sample")
            bar.close()  # the sample's lines begin on a line of their own, not on the bar's
            self.parallel.settle()  # the sample's steps run no block's forward hook, and the model is handed back
            sample = end_of_run_sample(self.model, self.data.tokenizer, tc, ctx, self.out_dir, self.log,
                                       stop=self.votes.interrupt_requested)
            if sample is None:  # Ctrl-C cut it short; the last step's checkpoint is written
                self._stop_interrupted(watchdog, checkpoint, "the end-of-run sample",
                                       redo="`megacpp sample --checkpoint {path}` samples from it")
        except BaseException as exc:
            # a warmup out-of-memory error of a supervised attempt leaves here, for a retry
            self.attempt.on_failure(exc, ctx.rank, self.batch.micro_batch, self.step + 1, self.device)
            if isinstance(exc, TrainingFault):  # its weights must not be what --resume continues from
                implicated = self.guard.implicated_from(self.losses, exc.suspect_step)
                raise exc.with_note(self.run_dir.set_aside_from(implicated)) from None
            raise
        finally:
            if watchdog is not None:
                watchdog.close()
            after_warmup.close()
            records.flush_after_stop()
            bar.close()
            if metrics is not None:
                metrics.log(self.step, "compile", {**self.health.summary(), **compile_record})
                metrics.close()
            self.health.close()
        if ctx.is_main:
            self.log(f"loss curve: {plot_loss(metrics.path, self.out_dir / 'loss.png')}")
        return TrainResult(self.out_dir, self.step, self.losses, records.evaluation, self.data.baselines, checkpoint,
                           sample, ctx.rank, self.device.type, out_of_time, spike_summary(records.norm_history))

    def _model_prewarm_line(self) -> str:
        """After the first step: what the model helpers did (those still compiling are stopped) and how
        many of the first forward and backward's graphs came from the cache."""
        prewarm, self.model_prewarm = self.model_prewarm, None
        line = prewarm.outcome()
        if self.model_cache_counts is not None:
            hits, misses = self.model_cache_counts
            line += f"; the model's graphs from the cache: {hits} of {hits + misses}"
        return line

    def _nothing_to_train(self) -> TrainResult:
        """A resumed run already at train.steps or past its time budget: say so and end cleanly (no metrics,
        plot or sample)."""
        tc = self.cfg.train
        if self.step >= tc.steps:
            self.log(f"nothing to train: the run in {self.out_dir} is at step {self.step} and train.steps is "
                     f"{tc.steps}; raise --train.steps to train further")
        else:
            self.log(f"nothing to train: the run in {self.out_dir} has spent {self.votes.elapsed_before:.0f} s of "
                     f"its train.time_budget_s {tc.time_budget_s:g}; raise --train.time_budget_s to train further")
        return TrainResult(self.out_dir, self.step, self.losses, None, self.data.baselines, None, "",
                           self.ctx.rank, self.device.type)

    def _expect_progress(self, watchdog: StepWatchdog | None, what: str) -> None:
        """Arm the stall watchdog for the next phase; not during warmup, whose compiles may take long."""
        if watchdog is not None and self.health.warm:
            watchdog.arm(self.cfg.dist.step_timeout_s, what)

    def _end_warmup(self, after_warmup: contextlib.ExitStack) -> dict[str, Any]:
        """Compile health on (and across) ranks, then the tight timeouts of steady training."""
        self.health.end_warmup()
        summary = check_compile_health(self.ctx, self.health, "after warmup")
        if self.cfg.compile.forbid_recompiles:
            after_warmup.enter_context(forbid_recompiles())
        if self.ctx.set_timeout(self.cfg.dist.step_timeout_s):
            self.log(f"warmup done: process-group timeout now {self.cfg.dist.step_timeout_s:.0f} s")
        graphs = sum(r["graphs"] for r in summary["regions"].values())
        return {"graphs_per_rank": self.ctx.all_gather_objects(graphs)}

    def _record_step(self, records: StepRecords, loss: float, tok_s: float, final: bool) -> None:
        host = {"loss": loss, "tok_per_s": tok_s, "tok_per_s_per_gpu": tok_s / self.ctx.world_size,
                "elapsed_s": self.votes.elapsed()}
        on_device: dict[str, Tensor | float] = {**self.stack.metrics, **self.grad_norms}
        if self.block_grad_norms is not None:
            on_device["block_grad_norms"] = self.block_grad_norms
        records.start(self.step, final, host, on_device, self.ctx.world_size, self.device)

    def _evaluate(self, records: StepRecords, watchdog: StepWatchdog | None) -> None:
        """Validation bits per byte at this step. Ctrl-C before or during it skips (the rest of) it: this
        step is saved and the run stops."""
        self._expect_progress(watchdog, f"evaluation at step {self.step}")
        self.parallel.settle()
        elapsed = self.votes.elapsed()  # before the evaluation: the time it took to get here
        interrupted_before = self.votes.interrupt_requested()
        evaluation = None if interrupted_before else evaluate_bpb(
            self.model, self.data, self.device, self.cfg.train.eval_batches, self.ctx, self.batch.micro_batch,
            stop=self.votes.interrupt_requested)
        if evaluation is None:
            self._stop_interrupted(watchdog, None, None if interrupted_before else "the evaluation",
                                   redo="its final evaluation was skipped: `megacpp eval --checkpoint {path}` "
                                        "runs it")
        if records.metrics is not None:
            records.metrics.log(self.step, "val", {**evaluation.record(),
                                                   "tokens": self.step * self.batch.tokens_per_step,
                                                   "elapsed_s": elapsed})
        records.show_validation(evaluation)

    def _check_replicas(self) -> None:
        """State every rank holds whole must be identical (buffers such as MoE biases, loader, schedule).
        Nothing on one process: the fingerprint hashes every unsharded tensor (there: the whole model)."""
        if not self.ctx.distributed:
            return
        self.parallel.settle()
        extra = {"loader": self.data.loader.state_dict(), "schedule": self.stack.scheduler.state_dict(),
                 "step": self.step}
        check_parity(self.ctx, replica_fingerprint(self.model, extra, self.parallel.expert_params), f"step {self.step}")

    def run_header(self) -> str:
        tc = self.cfg.train
        lines = [
            f"device {self.device}, mode {self.mode['mode']}, compile {self.cfg.compile.mode} "
            f"({self.cfg.compile.backend}, CUDA graphs {self.parallel.compiled.cudagraphs_why}), "
            f"{self.stack.describe_steps()}; {self.ctx.describe()}"
            + (f"; {self.parallel.describe()}" if self.ctx.distributed else ""),
            self.compile_status.format(),
            self.step_prewarm_note,
            *([self.model_prewarm_note] if self.model_prewarm_note else []),
            f"model {self.cfg.model.pattern} x depth {self.cfg.model.depth} ({self.model.layout}), "
            f"d_model {self.cfg.model.d_model}, vocab {self.cfg.model.vocab_size}",
            self.parameter_table,
            self.routing_table,
            f"{self.batch.describe()}, {tc.steps} steps"
            + (f" or {tc.time_budget_s:g} s, whichever comes first" if tc.time_budget_s else ""),
            self.data.baselines.summary(),
        ]
        return "\n".join(lines)

    # ---------------------------------------------------------------- steps

    def train_step(self) -> float:
        """One optimizer step: grad_accum loader batches, each as batch_size / micro_batch micro-batches
        of its rows; every micro-batch's mean loss is weighted by 1 / (number of micro-batches).

        The step's loss is read before the optimizer step (a non-finite loss stops the run before it
        reaches the weights), but it is copied to the host behind the last forward, so waiting for it
        does not wait for the last backward: the host queues the optimizer step while the GPU still
        runs the backward (on `small` that step takes more host time than device time)."""
        plan, clock = self.batch, self.phase_clock
        clock.start()
        if self.parallel.compiled.cudagraphs:
            begin_graph_step()
        total = torch.zeros((), device=self.device)
        last_batch = None
        loss_read = None
        self.reduce_statistics.begin_step(plan.micro_steps)
        before = fx_cache_counts() if self.model_prewarm is not None else None
        for accum in range(plan.grad_accum):
            pieces = plan.split(next(self.data.loader))
            clock.mark("data")
            for index, (x, y, doc_ids) in enumerate(pieces):
                with autocast_context(self.device):
                    loss = self.model(x, y, doc_ids) / plan.micro_steps
                clock.mark("forward")
                self.reduce_statistics.after_forward()
                total += loss.detach()
                last_batch = (x, doc_ids)
                if accum == plan.grad_accum - 1 and index == len(pieces) - 1:
                    reductions = {"reduced": self.ctx.all_reduce_(total.clone()), "local": total}
                    loss_read = Readback(self.votes.queue(reductions))
                    self.parallel.before_last_backward()
                loss.backward()
                clock.mark("backward")
        self.parallel.after_backward()
        self.reduce_statistics()
        read = loss_read.result()
        clock.mark("gradient exchange")
        self.votes.record(read)
        value = read["reduced"] / self.ctx.world_size
        if not math.isfinite(value):
            stop_nonfinite_loss(self.ctx, self.model, self.step + 1, value, read["local"], last_batch)
        self.grad_norms, self.block_grad_norms = self.part_grad_norms.measure()  # before the optimizer clips
        clock.mark("gradient norms")
        if before is not None:
            self.model_cache_counts = tuple(now - then for now, then in zip(fx_cache_counts(), before, strict=True))
        prewarm, self.step_prewarm = self.step_prewarm, None
        if prewarm is not None:
            self.log(prewarm.wait())
        self.stack.step()
        if prewarm is not None:
            self.log(prewarm.cache_line())
        if self.step_jobs:  # the first step compiled its graphs: later runs need no helper for them
            failed = mark_compiled(self.step_jobs)
            if failed:
                self.log(failed)
            self.step_jobs = {}
        run_after_optimizer_step(self.model)
        clock.mark("optimizer step")
        self.stack.zero_grad()
        return value

    def _stop_interrupted(self, watchdog: StepWatchdog | None, just_saved: Path | None,
                          during: str | None = None, redo: str | None = None) -> None:
        """Save at this step (all ranks together) unless this step's checkpoint was just written, and stop
        (megacpp.train.report.interruption says how)."""
        if just_saved is None:
            self._expect_progress(watchdog, f"checkpoint at step {self.step} (interrupted)")
        path = just_saved or self.save()
        received = self.votes.sigint.received if self.votes.sigint is not None else None
        raise interruption(self.step, self.cfg.train.steps, path, just_saved is not None, during, redo, received)

def train(cfg: Config, resume: bool = False, log=print, progress: bool = True,
          attempt: Attempt | None = None) -> TrainResult:
    return Trainer(cfg, log=log, progress=progress, resume=resume, attempt=attempt).run(resume=resume)
