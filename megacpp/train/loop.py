"""The training loop: data, model, optimizers, compile, checkpoints, evaluation, plot and sample.

One loop for one process and for every rank of a torchrun job. The `DistContext` makes collectives
no-ops on one process; under torchrun the model is sharded with FSDP2 (megacpp.distributed.parallelize),
every per-rank statistic is reduced, ranks are checked for parity at start, after warmup and
periodically, and a watchdog ends a stalled job. Only rank 0 writes metrics, plots and samples.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from megacpp.compile.entry import prepare_compile
from megacpp.compile.health import CompileHealth, bounds_for, forbid_recompiles
from megacpp.config import Config, dump_toml, to_dict
from megacpp.data.baselines import Baselines
from megacpp.distributed import checkpoint as dist_checkpoint
from megacpp.distributed.context import DistContext, init_distributed, torchrun_world
from megacpp.distributed.health import check_compile_health
from megacpp.distributed.logs import RankLog
from megacpp.distributed.muon import ShardedMuon
from megacpp.distributed.parallelize import parallelize
from megacpp.distributed.parity import (
    check_parity,
    dynamo_policy,
    library_versions,
    model_layout,
    relevant_env,
    replica_fingerprint,
    shared_config,
    tensor_digest,
)
from megacpp.distributed.stats import StatisticsReducer
from megacpp.distributed.watchdog import StepWatchdog
from megacpp.errors import Interrupted, MegacppError
from megacpp.model.hints import collect_param_hints, run_after_optimizer_step
from megacpp.model.hybrid import HybridLM
from megacpp.model.params import flops_per_token, parameter_table
from megacpp.ops.fast_paths import kernel_report
from megacpp.optim import build_optimizers
from megacpp.optim.local import local_tensor
from megacpp.runtime.checkpoint import CheckpointError, check_compatible, check_resume_settings, read_meta
from megacpp.runtime.data import build_data
from megacpp.runtime.device import autocast_context, peak_flops
from megacpp.runtime.evaluate import evaluate_bpb
from megacpp.runtime.generate import generate_tokens, stream_text
from megacpp.runtime.model_size import check_model_fits
from megacpp.train.autofit import TEST_OOM_ENV, WINDOW_STEPS, AutoFitChild, injected_oom, micro_batches
from megacpp.train.determinism import configure_mode, rng_state, seed_everything, set_rng_state
from megacpp.train.grad_norms import NormHistory, PartGradNorms, spike_summary
from megacpp.train.interrupt import SigintFlag
from megacpp.train.metrics import MetricsLogger, plot_loss
from megacpp.train.readback import Readback
from megacpp.train.rundir import RunDirError, RunLock, claim_run_dir
from megacpp.validate import validate_config
from megacpp.versions import torch_version


class NonFiniteLossError(MegacppError, RuntimeError):
    """Training produced a NaN or infinite loss; the last good checkpoint is left untouched."""


class NonFiniteWeightsError(MegacppError, RuntimeError):
    """A weight holds NaN or infinity at checkpoint time: the checkpoint is not written."""


class DivergenceError(MegacppError, RuntimeError):
    """Training diverged without a NaN (a loss far above chance, or no gradient at all)."""


# Divergence rule: at initialization the model predicts close to uniformly, a loss of ln(vocab_size)
# (plus the weighted MTP loss). A loss DIVERGED_FACTOR times that level for DIVERGED_STEPS consecutive
# steps means the model is much worse than knowing nothing: a learning rate or data problem that
# would otherwise burn the rest of the run. One spike does not stop it.
DIVERGED_FACTOR = 1.5
DIVERGED_STEPS = 3


def uniform_loss(model_cfg: Any) -> float:
    """The loss of predicting every token uniformly, as the model's loss counts it."""
    mtp_weight = model_cfg.mtp_loss_weight if model_cfg.mtp_depth > 0 else 0.0
    return math.log(model_cfg.vocab_size) * (1.0 + mtp_weight)


def first_nonfinite_parameter(model: nn.Module) -> str | None:
    """The name of the first parameter whose local values (this rank's shard) are not all finite.
    One host sync for all parameters."""
    named = [(name, local_tensor(p)) for name, p in model.named_parameters()]
    if not named:
        return None
    with torch.no_grad():
        finite = torch.stack([torch.isfinite(t).all() for _, t in named]).cpu()
    bad = (~finite).nonzero()
    return named[int(bad[0])][0] if len(bad) else None


@dataclass
class StepVote:
    """What the ranks agreed on with a step's loss: whether any of them had Ctrl-C by its last forward,
    and the longest elapsed training time then (every rank reads the same values)."""
    interrupted: bool
    elapsed: float


@dataclass
class PendingRecord:
    """A step's metrics record whose device figures are on their way to the host. The loop writes it
    a step later, when they have long arrived: reading them at once would wait for the optimizer step
    queued after them and leave the GPU idle while the host queues the next forward."""
    step: int
    final: bool
    host: dict[str, float]  # loss, tokens/s, elapsed time
    device: Readback  # gradient norms and optimizer metrics
    tail: dict[str, float]  # MFU and peak memory, last in the record


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    losses: list[float]
    val_bpb: float | None
    baselines: Baselines
    checkpoint: Path | None
    sample: str
    rank: int = 0  # under torchrun only rank 0 reports
    device_type: str = "cpu"
    out_of_time: bool = False  # train.time_budget_s ended the run before train.steps
    grad_spikes: str | None = None  # grad_norms.spike_summary of this process's steps


def find_nonfinite_sublayer(model: nn.Module, x: Tensor, doc_ids: Tensor) -> str:
    """Re-run one batch eagerly through ``forward`` and name the first sublayer whose output is not
    finite. Forward hooks, not a hand-written walk: under FSDP2 every rank must run the same whole
    forward (each block gathers its weights collectively)."""
    outputs: list[tuple[str, bool]] = []

    def watch(label: str):
        def hook(_module: nn.Module, _args: Any, output: Tensor) -> None:
            outputs.append((label, bool(torch.isfinite(output).all())))
        return hook

    watched = [(m, "the embeddings") for m in (model.tok_embed, model.ngram_embed) if m is not None]
    watched += [(b, f"sublayer {i} ({b.kind}: {type(b.mixer).__name__})") for i, b in enumerate(model.blocks)]
    handles = [module.register_forward_hook(watch(label)) for module, label in watched]
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            model(x, doc_ids=doc_ids)
    finally:
        for handle in handles:
            handle.remove()
    return next((label for label, finite in outputs if not finite),
                "no sublayer in a re-run (the loss or backward overflowed)")


def weight_fingerprint(model: nn.Module) -> str:
    """A digest of every weight's float64 sum and sum of squares (cheap on the device, and any
    difference between ranks' initial weights changes it)."""
    with torch.no_grad():
        moments = [(name, torch.stack([p.double().sum(), p.double().square().sum()]))
                   for name, p in model.state_dict().items() if p.is_floating_point()]
    return tensor_digest(moments)


class Trainer:
    def __init__(self, cfg: Config, log=print, progress: bool = True, ctx: DistContext | None = None,
                 resume: bool | None = None, autofit: AutoFitChild | None = None) -> None:
        """`resume` given here claims the run directory before any data or model work (the CLI does);
        left None, `run` claims it. `autofit`: this process is an attempt started by the auto-fit
        supervisor, which holds the run directory for every attempt (nothing to claim here)."""
        self.cfg = cfg
        tc = cfg.train
        # Configs built in Python never met load_config: fail on what the config alone can tell
        # before minutes of corpus and tokenizer work.
        validate_config(cfg)
        self.mode = configure_mode(tc.deterministic)
        # env and Dynamo policy: before any compile or process group
        self.compile_status = prepare_compile(cfg.compile, process_group_timeout_s=cfg.dist.init_timeout_s)
        self.autofit = autofit
        self.ctx = ctx or self._init_distributed()
        self.log = log
        self.run_lock: RunLock | None = None  # held by rank 0 while the run lives
        self.claimed = autofit is not None
        self._resume_from: Path | None = None  # the checkpoint --resume continues, once looked up
        self._resume_looked_up = False
        try:
            if resume is not None and not self.claimed:
                self._claim_run_dir(resume)
            if resume:  # before the data work, which can take minutes: an incompatible resume stops here
                self._check_resume_settings()
            self._build(log, progress)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _init_distributed(self) -> DistContext:
        """The process group; an auto-fit attempt meets its peers in a store namespace of its own, and a
        retry forms its NCCL communicators lazily (megacpp.distributed.rendezvous)."""
        tc = self.cfg.train
        if self.autofit is None:
            return init_distributed(tc.device, self.cfg.dist, tc.out_dir)
        _, world, _ = torchrun_world()
        store = self.autofit.connect(world, self.cfg.dist.init_timeout_s)
        return init_distributed(tc.device, self.cfg.dist, tc.out_dir, store=store, eager_nccl=not self.autofit.is_retry)

    def _build(self, log, progress: bool) -> None:
        cfg, tc, ctx = self.cfg, self.cfg.train, self.ctx
        self.device = ctx.device
        self.out_dir = Path(tc.out_dir)
        self.log = RankLog(self.out_dir, ctx.rank, log if ctx.is_main else None) if ctx.distributed else log
        self.progress = progress and ctx.is_main
        seed_everything(tc.seed)
        # Before the data (which may take minutes): the tokenizer's vocabulary is data.vocab_size.
        check_model_fits(dataclasses.replace(cfg.model, vocab_size=cfg.data.vocab_size), self.device)
        self.data = build_data(cfg.data, tc.seed, tc.batch_size, self.device, self.log, self.progress,
                               rank=ctx.rank, world_size=ctx.world_size)
        cfg.model.vocab_size = self.data.tokenizer.vocab_size
        torch.manual_seed(tc.seed)  # model init draws from a fixed point, whatever the data step drew
        self.model = HybridLM(cfg.model).to(self.device)
        # Fingerprinted before sharding (the whole weights); only a job of several ranks compares it.
        initial_weights = weight_fingerprint(self.model) if ctx.distributed else None
        hints = collect_param_hints(self.model)  # by name, before FSDP2 replaces the parameters
        self.health = CompileHealth(bounds_for(cfg.compile))
        self.health.attach(parallelize(self.model, cfg.compile, cfg.dist, ctx))
        self.stack = build_optimizers(self.model, cfg.optim, total_steps=tc.steps, log=None, hints=hints,
                                      classes={"muon": ShardedMuon} if ctx.distributed else None,
                                      model_compiled=cfg.compile.mode != "none")
        self.reduce_statistics = StatisticsReducer(self.model, ctx)
        self.part_grad_norms = PartGradNorms(self.model, ctx)
        self.grad_norms: dict[str, Tensor] = {}  # the last step's, per part, logged with its record
        self.block_grad_norms: Tensor | None = None  # the last step's, per block
        self.norm_history = NormHistory()  # for the end-of-run line
        self.step = 0
        self.micro_batch = tc.micro_batch or tc.batch_size  # rows per forward/backward
        self.steps_started = 0  # by this process: the auto-fit warmup window counts them
        self.oom_hook = TEST_OOM_ENV in os.environ
        self.elapsed_before = 0.0  # training wall time of the run before this process (a resume)
        self._t_start: float | None = None  # when this process's training loop started
        self.high_loss_steps = 0  # consecutive steps above the divergence level
        self.sigint: SigintFlag | None = None  # Ctrl-C's flag while the loop runs
        self.step_vote: StepVote | None = None  # the last train_step's, on several ranks
        self.losses: list[float] = []
        if ctx.distributed:  # one process has nobody to compare with: build nothing
            check_parity(ctx, {
                "config": shared_config(to_dict(cfg)), "versions": library_versions(self.device),
                "determinism": self.mode, "dynamo_policy": dynamo_policy(), "environment": relevant_env(),
                "kernels": kernel_report(), "tokenizer": self.data.tokenizer_hash, "data": self.data.shards.key,
                "global_batch": ctx.world_size * tc.batch_size, "parameters": model_layout(self.model),
                "initial_weights": initial_weights,
            }, "at start")

    def close(self, orderly: bool = False) -> None:
        """Release the run directory and leave the process group (every exit path: a live group keeps
        peers waiting); ``orderly`` at the end of a run that every rank finished."""
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None
        self.ctx.close(orderly)

    def _claim_run_dir(self, resume: bool) -> None:
        """Rank 0 locks the run directory and refuses to destroy a previous run there (megacpp.train.
        rundir); every rank raises the same error."""
        error = None
        if self.ctx.is_main:
            try:
                self.run_lock = claim_run_dir(Path(self.cfg.train.out_dir), resume, self.cfg.train.overwrite,
                                              self.log)
            except RunDirError as exc:
                error = str(exc)
            except OSError as exc:
                error = f"train.out_dir {self.cfg.train.out_dir}: {exc.strerror or exc}: {exc.filename}"
        error = self.ctx.broadcast_object(error)
        if error is not None:
            raise RunDirError(error)
        self.claimed = True

    def _fail(self, exc: BaseException) -> None:
        """Put a rank's failure in its own log file (torchrun shows only the first failing rank)."""
        if self.ctx.distributed and isinstance(self.log, RankLog):
            self.log.record(f"failed: {type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}")
        self.close()

    @property
    def global_batch(self) -> int:
        """Sequences per loader step over all ranks (the token stream depends on this alone)."""
        return self.ctx.world_size * self.cfg.train.batch_size

    # ---------------------------------------------------------------- state

    def meta(self) -> dict[str, Any]:
        return {"config": to_dict(self.cfg), "tokenizer_hash": self.data.tokenizer_hash,
                "determinism": self.mode, "torch": str(torch_version()),
                "world_size": self.ctx.world_size, "global_batch": self.global_batch, "micro_batch": self.micro_batch}

    def save(self) -> Path:
        self._check_finite_weights()
        state = {"step": self.step, "optim": self.stack.state_dict(), "loader": self.data.loader.state_dict(),
                 "rng": rng_state(self.device), "losses": torch.tensor(self.losses, dtype=torch.float64),
                 "elapsed_s": self.elapsed()}
        extra = {"tokenizer.json": self.data.tokenizer_json()} if self.ctx.is_main else None
        return dist_checkpoint.save(self.ctx, self.out_dir, self.step, self.model, self.stack.moments(), state,
                                    self.meta(), self.cfg.train.keep_last, extra)

    def _check_finite_weights(self) -> None:
        """Never write a checkpoint of non-finite weights: it would replace good ones when pruning."""
        reports = self.ctx.all_gather_objects(first_nonfinite_parameter(self.model))
        bad = [(rank, name) for rank, name in enumerate(reports) if name is not None]
        if bad:
            rank, name = bad[0]
            where = f" (rank {rank})" if self.ctx.distributed else ""
            raise NonFiniteWeightsError(
                f"step {self.step}: parameter {name}{where} holds NaN or infinite values; the checkpoint was "
                f"not written and the previous ones under {self.out_dir / 'checkpoints'} are untouched")

    def _resume_checkpoint(self) -> Path | None:
        """The newest verified checkpoint of the run directory (rank 0's choice, on every rank), looked up
        (and hashed) once however often it is asked for."""
        if not self._resume_looked_up:
            out_dir = Path(self.cfg.train.out_dir)
            self._resume_from = dist_checkpoint.find_resume_checkpoint(self.ctx, out_dir, warn=self.log)
            self._resume_looked_up = True
        return self._resume_from

    def _check_resume_settings(self) -> list[tuple[str, Any, Any]]:
        """Refuse a resume whose settings cannot continue the checkpoint's run, from the configuration
        alone (megacpp.runtime.checkpoint.check_resume_settings); every rank raises the same error.
        Returns the resumable model settings that change, (key, checkpoint's, now)."""
        path = self._resume_checkpoint()
        if path is None:
            return []
        error, changed = None, []
        try:
            changed = check_resume_settings(read_meta(path), to_dict(self.cfg), self.ctx.world_size, path)
        except CheckpointError as exc:
            error = str(exc)
        first = next((e for e in self.ctx.all_gather_objects(error) if e is not None), None)
        if first is not None:
            raise CheckpointError(first)
        return changed

    def resume(self) -> Path | None:
        path = self._resume_checkpoint()
        if path is None:
            self.log(f"no checkpoint under {self.out_dir}; starting from step 0")
            return None
        changed = self._check_resume_settings()  # again for a Trainer built without resume=True
        for key, saved, now in changed:
            self.log(f"resuming with model.{key} = {now!r} (the checkpoint trained with {saved!r}): it changes how "
                     "the model is computed or bounded, not its weights")
        check_compatible(read_meta(path), to_dict(self.cfg.model), self.data.tokenizer_hash, path,
                         self.cfg.data.seq_len)
        state, meta = dist_checkpoint.load(self.ctx, path, self.model, self.stack.moments())
        self.stack.load_state_dict(state["optim"])
        self.data.loader.load_state_dict(state["loader"], self.cfg.dist.allow_global_batch_change)
        set_rng_state(state["rng"], self.device)
        self.step = int(state["step"])
        self.losses = state["losses"].tolist()
        self._reuse_micro_batch(meta.get("micro_batch"), path)
        self.elapsed_before = float(state.get("elapsed_s", 0.0))  # checkpoints before issue 13 lack it
        check_parity(self.ctx, {"checkpoint": str(path), "step": self.step,
                                "loader": self.data.loader.state_dict()}, "after resume")
        self.log(f"resumed from {path} at step {self.step}")
        return path

    def _reuse_micro_batch(self, recorded: int | None, path: Path) -> None:
        """A resumed run keeps the micro-batch its checkpoint recorded (auto-fit's choice, or the user's)
        unless train.micro_batch is set (by the user, or by the supervisor for a retry)."""
        tc = self.cfg.train
        if tc.micro_batch or recorded is None or recorded == self.micro_batch:
            return
        if tc.batch_size % recorded:
            self.log(f"resume: the micro-batch {recorded} recorded in {path / 'meta.json'} does not divide "
                     f"train.batch_size {tc.batch_size}; using micro-batch {self.micro_batch}")
            return
        self.micro_batch = tc.micro_batch = recorded
        self.log(f"resume: micro-batch {recorded} x {tc.batch_size // recorded} per batch of {tc.batch_size}, as "
                 f"recorded in {path / 'meta.json'} (set --train.micro_batch to choose another)")

    # ---------------------------------------------------------------- steps

    def train_step(self) -> float:
        """One optimizer step: grad_accum loader batches, each as batch_size / micro_batch micro-batches
        of its rows; every micro-batch's mean loss is weighted by 1 / (number of micro-batches).

        The step's loss is read before the optimizer step (a non-finite loss stops the run before it
        reaches the weights), but it is copied to the host behind the last forward, so waiting for it
        does not wait for the last backward: the host queues the optimizer step while the GPU still
        runs the backward (on `small` that step takes more host time than device time)."""
        tc = self.cfg.train
        micro_steps = tc.grad_accum * (tc.batch_size // self.micro_batch)
        total = torch.zeros((), device=self.device)
        last_batch = None
        loss_read = None
        for accum in range(tc.grad_accum):
            pieces = micro_batches(next(self.data.loader), self.micro_batch)
            for index, (x, y, doc_ids) in enumerate(pieces):
                if self.oom_hook and injected_oom(self.ctx.rank, self.micro_batch):
                    raise torch.OutOfMemoryError(f"{TEST_OOM_ENV}: injected at micro-batch {self.micro_batch}")
                with autocast_context(self.device):
                    loss = self.model(x, y, doc_ids) / micro_steps
                total += loss.detach()
                last_batch = (x, doc_ids)
                if accum == tc.grad_accum - 1 and index == len(pieces) - 1:
                    loss_read = Readback(self._step_reductions(total))
                loss.backward()
        self.reduce_statistics()
        read = loss_read.result()
        self.step_vote = StepVote(read["interrupted"] > 0, read["elapsed"]) if self.ctx.distributed else None
        value = read["reduced"] / self.ctx.world_size
        if not math.isfinite(value):
            self._stop_nonfinite(value, read["local"], last_batch)
        self.grad_norms, self.block_grad_norms = self.part_grad_norms.measure()  # before the optimizer clips
        self.stack.step()
        run_after_optimizer_step(self.model)
        self.stack.zero_grad()
        return value

    def _step_reductions(self, total: Tensor) -> dict[str, Tensor]:
        """The step's loss summed over ranks and, on several ranks, their Ctrl-C flags and elapsed times
        (max), queued behind the last forward: the step's end then needs no collective of its own, and
        reading them waits for no backward or optimizer step."""
        reduced = {"reduced": self.ctx.all_reduce_(total.clone()), "local": total}
        if self.ctx.distributed:
            flags = torch.tensor([float(self.sigint is not None and self.sigint.requested), self.elapsed()],
                                 dtype=torch.float64)
            if self.device.type == "cuda":  # from pageable memory the copy would wait for the queue
                flags = flags.pin_memory().to(self.device, non_blocking=True)
            self.ctx.all_reduce_(flags, "max")
            reduced["interrupted"], reduced["elapsed"] = flags[0], flags[1]
        return reduced

    def _stop_nonfinite(self, value: float, local: float, last_batch: tuple[Tensor, Tensor]) -> None:
        """Every rank stops together (each saw the same reduced loss), naming the sublayer."""
        where = find_nonfinite_sublayer(self.model, *last_batch)  # every rank: collectives in lockstep
        reports = self.ctx.all_gather_objects((math.isfinite(local), where))
        if self.ctx.distributed:
            bad = [f"rank {r}: first non-finite output at {w}" for r, (ok, w) in enumerate(reports) if not ok]
            where = "; ".join(bad) or f"no rank's own loss (the reduction overflowed); {where}"
            detail = f"loss is {value} on rank(s) {', '.join(str(r) for r, (ok, _) in enumerate(reports) if not ok)}"
        else:
            detail, where = f"loss is {value}", f"first non-finite output at {where}"
        raise NonFiniteLossError(f"step {self.step + 1}: {detail}; {where}. The last good checkpoint under "
                                 f"{self.out_dir / 'checkpoints'} is untouched.")

    def elapsed(self) -> float:
        """Training wall time of the run so far: this process's loop plus what a resumed checkpoint
        had recorded (compilation, evaluations and checkpoints included)."""
        running = time.perf_counter() - self._t_start if self._t_start is not None else 0.0
        return self.elapsed_before + running

    def _out_of_time(self) -> bool:
        """Whether train.time_budget_s is spent. Ranks' clocks differ: they agree on the largest (as it
        was at the step's last forward, voted with its loss), so every rank stops at the same step."""
        budget = self.cfg.train.time_budget_s
        if not budget:
            return False
        if not self.ctx.distributed:
            return self.elapsed() >= budget
        return self._step_vote().elapsed >= budget

    def _interrupted_at_step_end(self, sigint: SigintFlag) -> bool:
        """Ctrl-C at a step's end. Several ranks use what they voted with the step's loss, so a Ctrl-C
        during a step's backward or optimizer step stops the run after the next step: asking the ranks
        here would wait for the optimizer step to finish and leave the GPU idle while the next forward
        is queued. One process reads its flag."""
        if self.ctx.distributed:
            return self._step_vote().interrupted
        return sigint.requested

    def _step_vote(self) -> StepVote:
        """The ranks' vote of the step just taken (train_step makes one on several ranks)."""
        if self.step_vote is None:
            raise RuntimeError("no step has been voted on yet: train_step() comes first")
        return self.step_vote

    def _interrupt_requested(self, sigint: SigintFlag) -> bool:
        """Whether any rank got SIGINT (one scalar all-reduce: every rank stops at the same point; one
        process reads its flag alone, with no device work: this is asked before every evaluation batch
        and sampled token too)."""
        if not self.ctx.distributed:
            return sigint.requested
        flag = torch.tensor(float(sigint.requested), device=self.device)
        return bool(self.ctx.all_reduce_(flag, "max").item())

    def _stop_interrupted(self, watchdog: StepWatchdog | None, just_saved: Path | None,
                          during: str | None = None, redo: str | None = None) -> None:
        """Save at this step (all ranks together) unless this step's checkpoint was just written, and stop.
        ``during`` names the phase Ctrl-C cut short. A run already at train.steps is complete: instead of
        how to resume, the message says so, and ``redo`` (a format string of the checkpoint's ``{path}``)
        how to do what was skipped."""
        if just_saved is None:
            self._expect_progress(watchdog, True, f"checkpoint at step {self.step} (interrupted)")
            path = self.save()
            saved = f"saved checkpoint {path}"
        else:
            path = just_saved
            saved = f"no checkpoint was due: {just_saved} was just written"
        what = f"interrupted during {during} at step {self.step}" if during else f"interrupted at step {self.step}"
        steps = self.cfg.train.steps
        if self.step < steps:
            raise Interrupted(f"{what}; {saved}")
        if just_saved is not None:
            saved = f"its final checkpoint {path} was written"
        redo_hint = "; " + redo.format(path=path) if redo else ""
        raise Interrupted(f"{what}; {saved}; the run is complete (train.steps {steps}): nothing to resume{redo_hint}",
                          complete=True)

    def _start_record(self, loss: float, tok_s: float, final: bool, flops: float, peak: float | None
                      ) -> PendingRecord:
        """The step's metrics record: its host figures now, its device figures (gradient norms,
        optimizer metrics) copied behind the work that made them, to be read by `_write_record`."""
        host = {"loss": loss, "tok_per_s": tok_s, "tok_per_s_per_gpu": tok_s / self.ctx.world_size,
                "elapsed_s": self.elapsed()}
        on_device: dict[str, Tensor | float] = {**self.stack.metrics, **self.grad_norms}
        if self.block_grad_norms is not None:
            on_device["block_grad_norms"] = self.block_grad_norms
        tail = {}
        if peak:
            tail["mfu"] = flops * tok_s / self.ctx.world_size / peak
        if self.device.type == "cuda":
            tail["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return PendingRecord(self.step, final, host, Readback(on_device), tail)

    def _write_record(self, pending: PendingRecord, metrics: MetricsLogger | None, bar: tqdm,
                      val_bpb: float | None, check: bool = True) -> dict[str, str]:
        """Check a step for divergence (``check``), log its record (every train.log_every steps, and
        the last) and advance the progress bar; returns the bar's postfix."""
        device = pending.device.result()
        blocks = device.pop("block_grad_norms", None)
        record: dict[str, Any] = {**pending.host, **device}
        if blocks is not None:
            record["block_grad_norms"] = self.part_grad_norms.block_record(blocks)
        if "grad_norm" in record:
            self.norm_history.append(pending.step, record["grad_norm"], record.get("block_grad_norms"))
        record.update(pending.tail)
        if check:
            self._check_divergence(pending.step, record["loss"], record.get("grad_norm"))
        if metrics is not None and (pending.step % self.cfg.train.log_every == 0 or pending.final):
            metrics.log(pending.step, "train", record)
        postfix = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tok_per_s']:,.0f}"}
        if "mfu" in record:
            postfix["mfu"] = f"{100 * record['mfu']:.1f}%"
        if val_bpb is not None:
            postfix["val_bpb"] = f"{val_bpb:.3f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
        return postfix

    def _check_divergence(self, step: int, loss: float, grad_norm: float | None) -> None:
        """Stop a run that diverged without a NaN (the rule is at DIVERGED_FACTOR). Both values are
        global (the loss averaged over ranks, the norm of the sharded gradients): every rank agrees."""
        if grad_norm == 0.0:
            raise DivergenceError(f"step {step}: the gradient norm is exactly 0: nothing is learning (a "
                                  "detached loss, or every target ignored); the run was stopped")
        level = DIVERGED_FACTOR * uniform_loss(self.cfg.model)
        self.high_loss_steps = self.high_loss_steps + 1 if loss > level else 0
        if self.high_loss_steps >= DIVERGED_STEPS:
            raise DivergenceError(
                f"step {step}: loss {loss:.3f} above {level:.3f} ({DIVERGED_FACTOR} x the uniform-prediction "
                f"loss ln({self.cfg.model.vocab_size})) for {DIVERGED_STEPS} consecutive steps: training diverged; "
                f"lower the learning rates and resume from the last checkpoint under {self.out_dir / 'checkpoints'}")

    def run(self, resume: bool = False) -> TrainResult:
        try:
            if not self.claimed:
                self._claim_run_dir(resume)
            result = self._run(resume)
        except BaseException as exc:
            self._fail(exc)
            raise
        self.close(orderly=True)
        return result

    def _run(self, resume: bool) -> TrainResult:
        cfg, tc, ctx = self.cfg, self.cfg.train, self.ctx
        self._check_shared_run_dir()
        if resume:  # before anything in out_dir is written: an incompatible resume changes nothing
            self.resume()
        if self.step >= tc.steps:
            return self._nothing_to_train()
        if ctx.is_main:
            (self.out_dir / "config.toml").write_text(dump_toml(cfg))
        self.log(self.run_header())
        metrics = MetricsLogger(self.out_dir, tc.tensorboard, resume=resume) if ctx.is_main else None
        if metrics is not None:  # the figures the plot and compare_quality.py draw beside val bits/byte
            metrics.log(self.step, "baselines", self.data.baselines.record())
        tokens_per_step = self.global_batch * tc.grad_accum * cfg.data.seq_len
        flops = flops_per_token(self.model, cfg.data.seq_len)
        peak = peak_flops(self.device)
        val_bpb: float | None = None
        checkpoint: Path | None = None
        bar = tqdm(total=tc.steps, initial=self.step, disable=not self.progress, dynamic_ncols=True,
                   desc="train", unit="step")
        watchdog = StepWatchdog(self.out_dir / "logs", ctx.rank) if ctx.distributed else None
        after_warmup = contextlib.ExitStack()
        compile_record: dict[str, Any] = {}
        sigint = self.sigint = after_warmup.enter_context(SigintFlag())
        out_of_time = False
        pending: PendingRecord | None = None  # a step whose record waits for its device figures
        postfix: dict[str, str] = {}
        try:
            t_last = self._t_start = time.perf_counter()
            warm = False
            while self.step < tc.steps:
                self._expect_progress(watchdog, warm, f"step {self.step + 1}")
                self.steps_started += 1
                loss = self.train_step()
                self.step += 1
                if not warm:  # every compiled region has run once: from here a recompile is a regression
                    compile_record = self._end_warmup(after_warmup)
                    warm = True
                    if self.autofit is not None:
                        self.log(self.autofit.first_step_line(self.micro_batch))
                self.losses.append(loss)
                out_of_time = self.step < tc.steps and self._out_of_time()  # same step on every rank
                final = self.step == tc.steps or out_of_time  # log, evaluate and save the last step
                now = time.perf_counter()
                tok_s = tokens_per_step / max(now - t_last, 1e-9)
                t_last = now
                record = self._start_record(loss, tok_s, final, flops, peak)
                if pending is not None:  # the previous step's figures arrived while this step was queued
                    postfix = self._write_record(pending, metrics, bar, val_bpb)
                pending = record
                checkpoint_due = self.step % tc.ckpt_every == 0 or final
                evaluation_due = self.step % tc.eval_every == 0 or final
                if evaluation_due or checkpoint_due:  # both wait for the device anyway: this step's record now
                    postfix, pending = self._write_record(pending, metrics, bar, val_bpb), None
                if evaluation_due:
                    self._expect_progress(watchdog, warm, f"evaluation at step {self.step}")
                    elapsed = self.elapsed()  # before the evaluation: the time it took to get here
                    # Ctrl-C before or during the evaluation skips (the rest of) it: save this step, stop.
                    interrupted_before = self._interrupt_requested(sigint)
                    val_bpb = None if interrupted_before else evaluate_bpb(
                        self.model, self.data, self.device, tc.eval_batches, ctx, self.micro_batch,
                        stop=lambda: self._interrupt_requested(sigint))
                    if val_bpb is None:
                        self._stop_interrupted(watchdog, None, None if interrupted_before else "the evaluation",
                                               redo="its final evaluation was skipped: `megacpp eval --checkpoint "
                                                    "{path}` runs it")
                    if metrics is not None:
                        metrics.log(self.step, "val", {"val_bpb": val_bpb, "tokens": self.step * tokens_per_step,
                                                       "elapsed_s": elapsed})
                    bar.set_postfix({**postfix, "val_bpb": f"{val_bpb:.3f}"}, refresh=False)
                fingerprint_due = cfg.dist.fingerprint_every and self.step % cfg.dist.fingerprint_every == 0
                if checkpoint_due or fingerprint_due:
                    self._check_replicas()
                if checkpoint_due:
                    self._expect_progress(watchdog, warm, f"checkpoint at step {self.step}")
                    checkpoint = self.save()
                if self._interrupted_at_step_end(sigint):
                    self._stop_interrupted(watchdog, checkpoint if checkpoint_due else None)
                if out_of_time:
                    self.log(f"time budget of {tc.time_budget_s:g} s spent at step {self.step} "
                             f"({self.elapsed():.0f} s): evaluated and saved; stopping before train.steps {tc.steps}")
                    break
            self._expect_progress(watchdog, warm, "the final sample")
            sample = self.sample_text(stop=lambda: self._interrupt_requested(sigint))
            if sample is None:  # Ctrl-C cut it short; the last step's checkpoint is written
                self._stop_interrupted(watchdog, checkpoint, "the end-of-run sample",
                                       redo="`megacpp sample --checkpoint {path}` samples from it")
        except BaseException as exc:
            if self.autofit is not None:  # a warmup out-of-memory error leaves here, for a retry
                in_window = self.steps_started <= WINDOW_STEPS and checkpoint is None
                self.autofit.on_failure(exc, in_window, ctx.rank, self.micro_batch, self.step + 1, self.device)
            raise
        finally:
            if watchdog is not None:
                watchdog.close()
            after_warmup.close()
            if pending is not None and metrics is not None:
                # A run stopped between steps keeps its last step's record. Best effort: an error
                # here would replace the one that stopped the run.
                with contextlib.suppress(Exception):
                    self._write_record(pending, metrics, bar, val_bpb, check=False)
            bar.close()
            if metrics is not None:
                metrics.log(self.step, "compile", {**self.compile_summary(), **compile_record})
                metrics.close()
            self.health.close()
        if ctx.is_main:
            plot = plot_loss(metrics.path, self.out_dir / "loss.png")
            self.log(f"loss curve: {plot}")
        return TrainResult(self.out_dir, self.step, self.losses, val_bpb, self.data.baselines, checkpoint,
                           sample, ctx.rank, self.device.type, out_of_time, spike_summary(self.norm_history))

    def _nothing_to_train(self) -> TrainResult:
        """A resumed run already at train.steps: say so and end cleanly (no metrics, plot or sample)."""
        self.log(f"nothing to train: the run in {self.out_dir} is at step {self.step} and train.steps is "
                 f"{self.cfg.train.steps}; raise --train.steps to train further")
        return TrainResult(self.out_dir, self.step, self.losses, None, self.data.baselines, None, "",
                           self.ctx.rank, self.device.type)

    def _expect_progress(self, watchdog: StepWatchdog | None, warm: bool, what: str) -> None:
        """Arm the stall watchdog for the next phase; not during warmup, whose compiles may take long."""
        if watchdog is not None and warm:
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

    def _check_replicas(self) -> None:
        """State every rank holds whole must be identical (buffers such as MoE biases, loader, schedule).
        Nothing on one process: the fingerprint hashes every unsharded tensor (there: the whole model)."""
        if not self.ctx.distributed:
            return
        extra = {"loader": self.data.loader.state_dict(), "schedule": self.stack.scheduler.state_dict(),
                 "step": self.step}
        check_parity(self.ctx, replica_fingerprint(self.model, extra), f"step {self.step}")

    def _check_shared_run_dir(self) -> None:
        """Every rank must see rank 0's run directory: checkpoints are written there by all ranks."""
        if not self.ctx.distributed:
            return
        token = self.out_dir / "logs" / ".shared"
        if self.ctx.is_main:
            token.parent.mkdir(parents=True, exist_ok=True)
            token.write_text(str(id(self)))
        expected = self.ctx.broadcast_object(str(id(self)) if self.ctx.is_main else None)
        seen = token.is_file() and token.read_text() == expected
        hosts = self.ctx.all_gather_objects((seen, self.ctx.host))
        blind = sorted({host for ok, host in hosts if not ok})
        if blind:
            raise CheckpointError(f"train.out_dir {self.out_dir} is not on a filesystem shared with rank 0: "
                                  f"host(s) {', '.join(blind)} cannot see it. Multi-host runs need a shared "
                                  "run directory (checkpoints are written by every rank)")

    def compile_summary(self) -> dict[str, float]:
        totals = self.health.totals()
        return {"graphs": totals.graphs, "graph_break_sites": len(self.health.break_sites()),
                "recompiles_after_warmup": totals.recompiles_after_warmup, "compile_time_s": totals.compile_time_s}

    def run_header(self) -> str:
        tc = self.cfg.train
        lines = [
            f"device {self.device}, mode {self.mode['mode']}, compile {self.cfg.compile.mode} "
            f"({self.cfg.compile.backend}), optimizer step "
            f"{'compiled' if self.stack.optimizers[0].compile_step else 'eager'}; {self.ctx.describe()}",
            self.compile_status.format(),
            f"model {self.cfg.model.pattern} x depth {self.cfg.model.depth} ({self.model.layout}), "
            f"d_model {self.cfg.model.d_model}, vocab {self.cfg.model.vocab_size}",
            parameter_table(self.model),
            self.stack.routing_table,
            f"batch {tc.batch_size}{self._micro_batch_note()} x {self.ctx.world_size} rank(s) x "
            f"{tc.grad_accum} accum x {self.cfg.data.seq_len} tokens, {tc.steps} steps"
            + (f" or {tc.time_budget_s:g} s, whichever comes first" if tc.time_budget_s else ""),
            self.data.baselines.summary(),
        ]
        return "\n".join(lines)

    def _micro_batch_note(self) -> str:
        split = self.cfg.train.batch_size // self.micro_batch
        return f" (as {split} micro-batches of {self.micro_batch})" if split > 1 else ""

    def sample_text(self, stop: Callable[[], bool] | None = None) -> str | None:
        """Every rank decodes (a sharded model gathers weights collectively); rank 0's token choice is
        broadcast each step so ranks never disagree on when to stop. Rank 0 writes the text. ``stop``
        is asked before every token (every rank must get the same answer); when it ends the sample,
        nothing is written or printed and the result is None."""
        tc = self.cfg.train
        tok = self.data.tokenizer
        prompt = [tok.bos_id, *tok.encode(tc.sample_prompt)]
        stopped = False

        def stop_here() -> bool:
            nonlocal stopped
            stopped = stop is not None and stop()
            return stopped

        self.model.eval()
        with torch.compiler.set_stance("force_eager"):
            tokens = generate_tokens(self.model, prompt, tc.sample_tokens, tc.sample_temperature, tc.sample_top_k,
                                     tc.seed, stop_id={tok.bos_id, tok.eos_id}, agree=self.ctx.broadcast_,
                                     stop=stop_here)
            pieces = list(stream_text(tok, tokens))
        self.model.train()
        if stopped:
            return None
        text = tc.sample_prompt + "".join(pieces)
        if self.ctx.is_main:
            (self.out_dir / "sample.txt").write_text(text)
        self.log(f"--- sample ({tc.sample_tokens} tokens, temperature {tc.sample_temperature}, "
                 f"top-k {tc.sample_top_k}) ---\n{text}\n---")
        return text


def train(cfg: Config, resume: bool = False, log=print, progress: bool = True,
          autofit: AutoFitChild | None = None) -> TrainResult:
    return Trainer(cfg, log=log, progress=progress, resume=resume, autofit=autofit).run(resume=resume)
