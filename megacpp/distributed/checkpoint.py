"""Checkpoints that every rank writes and agrees on, and that load on any number of ranks.

Save (every rank calls it; on one process the collectives are no-ops):
1. rank 0 creates ``step_N.tmp/``; every rank must see it and be able to write there (a checkpoint
   needs a filesystem shared by all hosts);
2. the whole weights are gathered to rank 0 and the optimizer moments are written by every rank as a
   torch.distributed.checkpoint (DCP) directory, keyed by parameter name;
3. rank 0 writes ``model.safetensors``, ``state.pt``, the extra files and ``meta.json`` (hashes last);
4. every rank reports success or its error; only if all succeeded does rank 0 rename the directory
   into place and prune. Any failure raises the same error on every rank, naming each failed rank,
   and leaves the previous checkpoints untouched.

Load: rank 0 picks the newest checkpoint that verifies and tells the others; weights are read by rank
0 and broadcast into the shards; DCP reshards the moments to this run's ranks.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException

from megacpp.distributed.context import DistContext
from megacpp.distributed.expert_parallel import ExpertParallel
from megacpp.runtime.checkpoint import (
    MOMENTS_DIR,
    CheckpointError,
    checkpoint_dirs,
    latest_valid_checkpoint,
    load_train_state,
    publish,
    read_meta,
    write_local_files,
    write_meta,
)
from megacpp.runtime.phase_timer import PhaseTimer


def full_model_state(model: nn.Module, ctx: DistContext, experts: ExpertParallel | None = None
                     ) -> dict[str, Tensor] | None:
    """The whole weights (CPU) on rank 0, None on the others; every rank must call it. Expert-parallel
    rows are gathered one tensor at a time (a whole `nam52` expert tensor is ~0.5 GB)."""
    if not ctx.distributed:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for name, p in (experts.params.items() if experts is not None else ()):
        whole = experts.whole(p.detach())
        if ctx.is_main:
            state[name] = whole.cpu()
    return state if ctx.is_main else None


def checkpointed_moments(moments: dict[str, Tensor], experts: ExpertParallel | None) -> dict[str, Tensor]:
    """``moments`` with each expert-parallel moment (key "<optimizer>/<parameter>/<name>", with its
    parameter's expert axis first: the moments of a whole matrix or factored per matrix, e.g. Muon's
    second moment (E, 1, h)) as a view of the whole tensor, so that the checkpoint holds whole tensors: one
    format, resumable on any expert-parallel degree and number of ranks."""
    if experts is None:
        return moments
    out = {}
    for key, value in moments.items():
        param = experts.params.get(key.split("/")[1])
        per_expert = param is not None and value.ndim == param.ndim and value.shape[0] == param.shape[0]
        out[key] = experts.global_view(value) if per_expert else value
    return out


def _read_weights(path: Path, experts: ExpertParallel) -> dict[str, Tensor]:
    """Every weight of a checkpoint's ``model.safetensors``, with only this rank's rows of the expert-
    parallel ones (each rank reads the shared file itself)."""
    from safetensors import safe_open

    state = {}
    with safe_open(path / "model.safetensors", framework="pt", device="cpu") as f:
        for key in f.keys():
            if key in experts.params:
                rows = f.get_slice(key)
                start, stop = experts.rows_of(rows.get_shape()[0])
                state[key] = rows[start:stop]
            else:
                state[key] = f.get_tensor(key)
    return state


@contextlib.contextmanager
def _dcp_quiet() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process; that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _describe(exc: BaseException) -> str:
    """One line for a failure: the OS's words for an OSError (a full disk: "No space left on device"),
    each rank's failure of a DCP CheckpointException (rank -> exception, or on torch 2.13 (exception,
    frame summaries): the frames made a 4 KB line)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(_describe(f[0] if isinstance(f, tuple) else f) for f in failures.values())
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return f"{type(exc).__name__}: {exc}"


class _Agreement:
    """Collects this rank's failure of a phase; `settle` raises the same error on every rank."""

    def __init__(self, ctx: DistContext, step: int, tmp: Path) -> None:
        self.ctx, self.step, self.tmp = ctx, step, tmp
        self.error: str | None = None

    def fail(self, exc: BaseException) -> None:
        self.error = _describe(exc)

    def settle(self, phase: str) -> None:
        errors = self.ctx.all_gather_objects(self.error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        if self.ctx.is_main:
            shutil.rmtree(self.tmp, ignore_errors=True)
        shown = "; ".join(f"rank {r}: {e}" for r, e in failed) if self.ctx.distributed else failed[0][1]
        raise CheckpointError(f"checkpoint at step {self.step} was not saved ({phase}: {shown}); the previous "
                              f"checkpoints under {self.tmp.parent} are intact")


def save(ctx: DistContext, out_dir: str | Path, step: int, model: nn.Module, moments: dict[str, Tensor],
         train_state: dict[str, Any], meta: dict[str, Any], keep_last: int,
         extra_files: dict[str, bytes] | None = None, experts: ExpertParallel | None = None,
         log: Callable[[str], None] | None = None) -> Path:
    """Write checkpoint `step` (see the module docstring); returns its directory. `log` gets one line with
    the time of each phase (a large model's checkpoint can take as long as minutes of training)."""
    clock = PhaseTimer()  # each phase ends when every rank has finished it (the agreements settle it)
    final, tmp = checkpoint_dirs(out_dir, step)
    agreement = _Agreement(ctx, step, tmp)
    if ctx.is_main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / MOMENTS_DIR).mkdir(parents=True)
        except OSError as exc:
            agreement.fail(exc)
    agreement.settle("creating the directory")
    if not os.access(tmp / MOMENTS_DIR, os.W_OK):
        agreement.fail(PermissionError(f"{tmp / MOMENTS_DIR} is missing or not writable from {ctx.host} "
                                       "(checkpoints need a filesystem every host shares)"))
    agreement.settle("checking the directory")

    clock.mark("preparing the directory")
    model_state = full_model_state(model, ctx, experts)
    clock.mark("gathering the weights")
    try:
        with _dcp_quiet():
            dcp.save(checkpointed_moments(moments, experts), checkpoint_id=tmp / MOMENTS_DIR,
                     no_dist=not ctx.distributed)
    except (OSError, CheckpointException) as exc:
        agreement.fail(exc)
    agreement.settle("writing optimizer moments")
    clock.mark("optimizer moments")
    if ctx.is_main:
        try:
            write_local_files(tmp, model_state, train_state, extra_files)
            write_meta(tmp, step, meta)
        except (OSError, SafetensorError) as exc:
            agreement.fail(exc)
    agreement.settle("writing weights and metadata")
    clock.mark("weights, state and hashes (rank 0)")
    if ctx.is_main:
        publish(tmp, final, keep_last)
    ctx.barrier()
    clock.mark("publishing")
    if log is not None:
        log(clock.line(f"checkpoint {final.name} written in"))
    return final


def find_resume_checkpoint(ctx: DistContext, out_dir: str | Path, warn=print) -> Path | None:
    """Rank 0's newest verified checkpoint under `out_dir`, on every rank (broken ones are skipped)."""
    found = latest_valid_checkpoint(out_dir, warn=warn) if ctx.is_main else None
    chosen = ctx.broadcast_object(None if found is None else str(found))
    return None if chosen is None else Path(chosen)


def load(ctx: DistContext, path: Path, model: nn.Module, moments: dict[str, Tensor],
         experts: ExpertParallel | None = None) -> tuple[dict, dict]:
    """Load weights into `model` and moments in place into `moments` (any number of ranks, any expert-
    parallel degree); return (train_state, meta). The checkpoint was verified by `find_resume_checkpoint`."""
    meta = read_meta(path)
    try:
        if not ctx.distributed:
            model.load_state_dict(load_file(path / "model.safetensors", device=str(ctx.device)))
        elif experts is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # Every rank holds the whole weights of the file (its rows of the experts'): sharded (fsdp)
            # parameters take their rows of them.
            set_model_state_dict(model, _read_weights(path, experts), options=StateDictOptions(full_state_dict=True))
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            full = load_file(path / "model.safetensors", device="cpu") if ctx.is_main else {}
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                       broadcast_from_rank0=True))
        with _dcp_quiet():
            dcp.load(checkpointed_moments(moments, experts), checkpoint_id=path / MOMENTS_DIR,
                     no_dist=not ctx.distributed)
    except (SafetensorError, OSError, CheckpointException) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({_describe(exc)})") from exc
    return load_train_state(path, map_location="cpu"), meta
