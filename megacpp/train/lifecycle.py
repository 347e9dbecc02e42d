"""The run directory's lifecycle: claimed before any data or model work, seen by every rank, resumed
from its newest verified checkpoint under the resume rules, and saved into by every rank together.

Rank 0 decides (the claim, which checkpoint to resume) and every rank raises the same error; the
format of a checkpoint is megacpp.runtime.checkpoint's, its collective writing and loading
megacpp.distributed.checkpoint's, and the rules of a resume megacpp.train.resume_rules'.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from megacpp.config import Config, to_dict
from megacpp.distributed import checkpoint as dist_checkpoint
from megacpp.distributed.context import DistContext
from megacpp.distributed.expert_parallel import ExpertParallel
from megacpp.optim.schedule import LRScheduler, WarmupStableDecay, extend
from megacpp.run_config import from_dict
from megacpp.runtime.checkpoint import (
    CheckpointError,
    checkpoint_root,
    checkpoint_step,
    latest_valid_checkpoint,
    list_checkpoints,
    read_meta,
    set_aside,
)
from megacpp.train.resume_rules import check_compatible, check_resume_settings, rows_per_step, state_dtype_changes
from megacpp.train.rundir import RunDirError, RunLock, claim_run_dir


class RunDirectory:
    """``train.out_dir`` of one run, on every rank."""

    def __init__(self, cfg: Config, ctx: DistContext, log: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = log
        self.path = Path(cfg.train.out_dir)
        self.lock: RunLock | None = None  # held by rank 0 while the run lives
        self._resume_from: Path | None = None
        self._looked_up = False

    def claim(self, resume: bool) -> None:
        """Rank 0 locks the run directory and refuses to destroy a previous run there
        (megacpp.train.rundir); every rank raises the same error."""
        error = None
        if self.ctx.is_main:
            try:
                self.lock = claim_run_dir(self.path, resume, self.cfg.train.overwrite, self.log)
            except RunDirError as exc:
                error = str(exc)
            except OSError as exc:
                error = f"train.out_dir {self.cfg.train.out_dir}: {exc.strerror or exc}: {exc.filename}"
        error = self.ctx.broadcast_object(error)
        if error is not None:
            raise RunDirError(error)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def check_shared(self) -> None:
        """Every rank must see rank 0's run directory: checkpoints are written there by all ranks."""
        if not self.ctx.distributed:
            return
        token = self.path / "logs" / ".shared"
        if self.ctx.is_main:
            token.parent.mkdir(parents=True, exist_ok=True)
            token.write_text(str(id(self)))
        expected = self.ctx.broadcast_object(str(id(self)) if self.ctx.is_main else None)
        seen = token.is_file() and token.read_text() == expected
        hosts = self.ctx.all_gather_objects((seen, self.ctx.host))
        blind = sorted({host for ok, host in hosts if not ok})
        if blind:
            raise CheckpointError(f"train.out_dir {self.path} is not on a filesystem shared with rank 0: "
                                  f"host(s) {', '.join(blind)} cannot see it. Multi-host runs need a shared "
                                  "run directory (checkpoints are written by every rank)")

    def resume_checkpoint(self) -> Path | None:
        """The newest verified checkpoint (rank 0's choice, on every rank), looked up (and hashed) once
        however often it is asked for."""
        if not self._looked_up:
            self._resume_from = dist_checkpoint.find_resume_checkpoint(self.ctx, self.path, warn=self.log)
            self._looked_up = True
        return self._resume_from

    def check_resume_settings(self) -> list[tuple[str, Any, Any]]:
        """Refuse a resume whose settings cannot continue the checkpoint's run, from the configuration
        alone (megacpp.train.resume_rules); every rank raises the same error. Returns the resumable model
        settings that change, (key, checkpoint's, now)."""
        path = self.resume_checkpoint()
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

    def restore(self, path: Path, model_cfg: dict[str, Any], tokenizer_hash: str, model: nn.Module,
                moments: dict[str, Tensor], experts: ExpertParallel | None = None
                ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load checkpoint ``path`` into ``model`` and ``moments`` after checking that it is this model's,
        tokenizer's and sequence length's; returns (train state, meta)."""
        for key, saved, now in self.check_resume_settings():
            self.log(f"resuming with model.{key} = {now!r} (the checkpoint trained with {saved!r}): it changes how "
                     "the model is computed or bounded, not its weights")
        for line in state_dtype_changes(read_meta(path), to_dict(self.cfg)):
            self.log(line)
        check_compatible(read_meta(path), model_cfg, tokenizer_hash, path, self.cfg.data.seq_len)
        return dist_checkpoint.load(self.ctx, path, model, moments, experts)

    def extend_schedule(self, meta: dict[str, Any], scheduler: LRScheduler, position: int) -> None:
        """A resume with more train.steps than the checkpoint's run had: the schedule per
        optim.extend_schedule (megacpp.optim.schedule.extend), and a line saying what it does to the rate."""
        saved = from_dict(meta["config"], source="the checkpoint's meta.json")
        schedule, note = extend(WarmupStableDecay.from_config(saved.optim, saved.train.steps), scheduler.schedule,
                                position, self.cfg.optim.extend_schedule)
        scheduler.schedule = schedule
        scheduler.apply()
        if note is not None:
            self.log(note)

    def loader_may_change_batch(self, meta: dict[str, Any]) -> bool:
        """Whether the loader may continue a checkpoint written at another global batch: when the user
        allows it, or when the rows per optimizer step are the same (the same rows in every step)."""
        rows, saved_rows = rows_per_step(meta, to_dict(self.cfg), self.ctx.world_size)
        return self.cfg.dist.allow_global_batch_change or rows == saved_rows

    def set_aside_from(self, step: int) -> str:
        """Rank 0 renames every checkpoint of `step` or later (weights a divergence or non-finite loss
        implicates) out of the resume path (megacpp.runtime.checkpoint.set_aside); returns, on every rank,
        a note saying what moved and which checkpoint a resume now starts from."""
        note = None
        if self.ctx.is_main:
            moved = [set_aside(p, "diverged") for p in list_checkpoints(self.path) if checkpoint_step(p) >= step]
            healthy = latest_valid_checkpoint(self.path, warn=self.log)
            names = ", ".join(p.name for p in reversed(moved))
            note = f"checkpoint(s) saved from those weights set aside as {names}; " if moved else ""
            if healthy is not None:
                note += f"--resume continues from {healthy}, the last healthy checkpoint"
            else:
                note += (f"no healthy checkpoint is left under {checkpoint_root(self.path)}: the same command "
                         "without --resume starts over (keeping this run's files aside)")
        return self.ctx.broadcast_object(note)

    def save(self, step: int, model: nn.Module, moments: dict[str, Tensor], state: dict[str, Any],
             meta: dict[str, Any], tokenizer_json: Callable[[], bytes], *, in_doubt_from: int,
             experts: ExpertParallel | None = None) -> Path:
        """Checkpoint ``step``, written by every rank together (megacpp.distributed.checkpoint.save).
        Older checkpoints from step ``in_doubt_from`` on (saved from weights whose loss is already above the
        divergence level: a divergence would set them aside) do not count toward train.keep_last: pruning
        keeps that many besides them."""
        extra = {"tokenizer.json": tokenizer_json()} if self.ctx.is_main else None
        in_doubt = sum(in_doubt_from <= checkpoint_step(p) < step for p in list_checkpoints(self.path))
        return dist_checkpoint.save(self.ctx, self.path, step, model, moments, state, meta,
                                    self.cfg.train.keep_last + in_doubt, extra, experts, log=self.log)
