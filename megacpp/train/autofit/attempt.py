"""Out-of-memory auto-fit, the training process's side: the attempt this process is.

A CUDA run that runs out of memory in its warmup restarts with half the micro-batch and twice the
accumulation (`next_micro_batch`): each loader batch of ``train.batch_size`` rows is then run as
several micro-batches of the same rows, with the loss divided by the number of micro-batches, so the
global batch, the token stream and the learning-rate schedule do not change. The supervisor
(megacpp.train.autofit.supervisor) starts the training as a child and starts it again after such an
exit, with ``--train.micro_batch N`` added to its command line. The Trainer holds one `Attempt`:

- `Attempt`: a run of its own (no supervisor): it claims its run directory, and a failure is a failure;
- `SupervisedAttempt`: a child of the supervisor, which holds the run directory for every attempt. Its
  warmup window is the first `WINDOW_STEPS` optimizer steps of the process, closed early by the first
  checkpoint it publishes (a retry starts the run over, or resumes from the checkpoint the first
  attempt resumed from: nothing written in the window may outlive it). Three steps because memory
  peaks late: the optimizer state is allocated in step 1's update, so step 2's backward is the first
  with everything resident; step 3 is margin for the caching allocator's fragmentation. An
  out-of-memory error in the window: the rank writes its report (micro-batch, peak memory) to the job
  store (under torchrun) and to a file, prints one line and leaves with `OOM_EXIT_CODE`, at once
  (`os._exit`: tearing down a process group whose peers wait inside a collective can hang). Any other
  failure in the window while a peer reported an out-of-memory error (a collective broken by the
  peer's exit): the same exit, so the supervisor retries instead of reporting a crash.

Environment of a child (set by the supervisor): `ATTEMPT_ENV` (1, 2, ...), `REPORT_ENV`, `SPAWNED_ENV`,
`PARENT_ENV`.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megacpp.distributed.config import DistConfig
from megacpp.distributed.context import DistContext, init_distributed, torchrun_world
from megacpp.distributed.launch_env import PARENT_ENV, REPORT_ENV, SPAWNED_ENV
from megacpp.errors import MegacppError
from megacpp.train.autofit.rendezvous import attempt_store, job_store, oom_key

if TYPE_CHECKING:
    from torch.distributed import Store

WINDOW_STEPS = 3
OOM_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: "try again"; the supervisor does, with a smaller micro-batch

ATTEMPT_ENV = "MEGACPP_AUTOFIT_ATTEMPT"


class AutoFitError(MegacppError):
    """Out of memory in warmup even at the smallest micro-batch auto-fit may try."""


def next_micro_batch(batch_size: int, current: int, floor: int) -> int | None:
    """The micro-batch to retry with after `current` ran out of memory: the largest divisor of
    `batch_size` at most half of `current` (64 -> 32, 12 -> 6 -> 3 -> 1), or None below `floor`."""
    for candidate in range(current // 2, floor - 1, -1):
        if batch_size % candidate == 0:
            return candidate
    return None


def peak_memory(device: torch.device) -> tuple[str, int | None]:
    """(description, bytes) of this process's peak memory: the CUDA caching allocator's peak against
    the GPU's capacity; on CPU the peak resident set size (no device memory to speak of)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        return f"peak {peak / 2**30:.2f} GiB allocated of {total / 2**30:.2f} GiB on {device}", peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return f"peak host RSS {rss / 2**30:.2f} GiB on cpu", rss


def find_out_of_memory(exc: BaseException) -> torch.OutOfMemoryError | None:
    """The out-of-memory error behind `exc`, also when a compiler or wrapper re-raised it as another."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.OutOfMemoryError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


@dataclass
class OomReport:
    """What a rank says when it ran out of memory in warmup; the supervisors decide from it."""
    rank: int
    micro_batch: int
    step: int
    memory: str  # peak_memory's description
    peak_bytes: int | None
    error: str  # the first line of the error

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> OomReport:
        return cls(**json.loads(text))


class Attempt:
    """A run of its own, with no supervisor: it claims its run directory, and a failure is a failure."""

    claims_run_dir = True
    is_retry = False  # an auto-fit retry: an earlier attempt ran out of memory

    def init_distributed(self, device: str, dist: DistConfig, out_dir: str) -> DistContext:
        return init_distributed(device, dist, out_dir)

    def step_started(self) -> None:
        """An optimizer step begins."""

    def checkpoint_published(self) -> None:
        """A checkpoint of this process was renamed into place."""

    def first_step_line(self, micro_batch: int) -> str | None:
        """What to say once the first step is done (nothing, outside auto-fit)."""
        return None

    def on_failure(self, exc: BaseException, rank: int, micro_batch: int, step: int, device: torch.device) -> None:
        """Called with every failure of the run before it propagates; returns to let it propagate."""


class SupervisedAttempt(Attempt):
    """Attempt `attempt` of a run started by the auto-fit supervisor, which holds the run directory."""

    claims_run_dir = False

    def __init__(self, attempt: int, report_path: Path, spawned: float) -> None:
        self.attempt = attempt
        self.report_path = report_path
        self.spawned = spawned
        self.store: Store | None = None  # the job store under torchrun (set by `init_distributed`)
        self.steps_started = 0  # by this process: the warmup window counts them
        self.published = False  # a checkpoint of this process closes the window

    @property
    def is_retry(self) -> bool:
        return self.attempt > 1

    @property
    def in_window(self) -> bool:
        return self.steps_started <= WINDOW_STEPS and not self.published

    def init_distributed(self, device: str, dist: DistConfig, out_dir: str) -> DistContext:
        """The process group meets its peers in a store namespace of this attempt's own, and a retry forms
        its NCCL communicators lazily (megacpp.train.autofit.rendezvous)."""
        _, world_size, _ = torchrun_world()
        store = None
        if world_size > 1:
            self.store = job_store(dist.init_timeout_s)
            store = attempt_store(self.store, self.attempt)
        return init_distributed(device, dist, out_dir, store=store, eager_nccl=not self.is_retry)

    def step_started(self) -> None:
        self.steps_started += 1

    def checkpoint_published(self) -> None:
        self.published = True

    def first_step_line(self, micro_batch: int) -> str:
        return (f"auto-fit attempt {self.attempt}: first step done {time.time() - self.spawned:.1f} s after the "
                f"process started (micro-batch {micro_batch})")

    def peer_report(self) -> OomReport | None:
        """The report of a rank that ran out of memory in this attempt, if one did (torchrun only)."""
        key = oom_key(self.attempt)
        if self.store is None or not self.store.check([key]):
            return None
        return OomReport.from_json(self.store.get(key))

    def on_failure(self, exc: BaseException, rank: int, micro_batch: int, step: int, device: torch.device) -> None:
        """Leave for a retry (never returns) when `exc`, in the warmup window, is an out-of-memory error of
        this rank or follows from one of a peer's; return otherwise (the caller re-raises). Prints one line
        on this rank's stderr (its supervisor's log and terminal), never a traceback."""
        if not self.in_window:
            return
        who = f"rank {rank}: " if self.store is not None else ""
        oom = find_out_of_memory(exc)
        if oom is not None:
            memory, peak = peak_memory(device)
            first_line = (str(oom).strip().splitlines() or [type(oom).__name__])[0]
            report = OomReport(rank, micro_batch, step, memory, peak, first_line)
            self._publish(report)
            _say(f"{who}out of memory in warmup step {step} at micro-batch {micro_batch} ({memory}); "
                 "auto-fit retries with a smaller micro-batch")
            _exit(OOM_EXIT_CODE)
        peer = self.peer_report()
        if peer is not None and peer.rank != rank:
            _say(f"{who}stopping for the auto-fit retry: rank {peer.rank} ran out of memory in warmup step "
                 f"{peer.step} ({type(exc).__name__} here as a consequence)")
            _exit(OOM_EXIT_CODE)

    def _publish(self, report: OomReport) -> None:
        """The store first: a peer whose collective breaks when this process exits must find the key."""
        if self.store is not None:
            self.store.set(oom_key(self.attempt), report.to_json())
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        self.report_path.write_text(report.to_json())


def attempt_from_env() -> Attempt:
    """This process's attempt: a `SupervisedAttempt` in a child of the supervisor (which the kernel is
    then told to kill with its supervisor), else a plain `Attempt`."""
    if ATTEMPT_ENV not in os.environ:
        return Attempt()
    die_with_parent(int(os.environ[PARENT_ENV]))
    return SupervisedAttempt(int(os.environ[ATTEMPT_ENV]), Path(os.environ[REPORT_ENV]),
                             float(os.environ[SPAWNED_ENV]))


def _say(message: str) -> None:
    print(f"megacpp: {message}", file=sys.stderr)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent (pid `parent`: the supervisor of a training
    process, the trainer of an optimizer helper) dies, even by SIGKILL: an orphan would go on holding the
    GPU. Linux only."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        _exit(128 + signal.SIGKILL)
