"""The auto-fit supervisor: `megacpp train` on CUDA runs the training as a child process and starts it
again, with half the micro-batch, when it runs out of GPU memory in its warmup.

Why a child process: a retry must start clean. An out-of-memory error leaves the caching allocator
fragmented, compiled graphs specialised to the old shapes, and under torchrun a process group whose
peers may be blocked inside a collective; a fresh process has none of that, and needs no
``torch._dynamo.reset()`` at all.

One supervisor per process the user started: one in a plain run, one per rank under torchrun (each
rank's supervisor is torchrun's worker, and its child the training rank). The ranks agree through the
job's store (megacpp.train.autofit.rendezvous): the rank that runs out of memory sets a key before it
exits, every supervisor polls for it and stops its own child (which may be blocked in a collective
that will never complete), and all of them start the next attempt with the same micro-batch, which
meets in a fresh store namespace. The process-group timeout and the step watchdog stay the backstop.

What a supervisor does, in order:
1. claims the run directory for the whole invocation (rank 0; under torchrun the other ranks learn
   the outcome through the store and fail with the same line): attempts are one run, so a retry
   never trips over the files of the attempt before it;
2. runs attempt 1, 2, ... as ``python -m megacpp.cli <same arguments>``, a retry with
   ``--train.micro_batch N`` appended, and the attempt number and where to report in its
   environment; a retry's environment also lowers
   ``TORCH_DISTRIBUTED_DEBUG`` to OFF (a debug wrapper's store traffic is what broke retries in the
   stack this one re-creates) and sets torchrun's ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` if unset;
3. copies the child's output to the terminal and to ``logs/attempt<N>[.rank<R>].log`` (appended);
4. forwards SIGINT, SIGTERM and SIGHUP to the child (which runs in a session of its own so that a
   terminal's Ctrl-C reaches it exactly once: through here), so Ctrl-C still saves a checkpoint;
5. exits with the child's status (a signal's as 128 + its number), printing the tail of the
   child's output when it failed for any reason but Ctrl-C or a retry.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from megacpp.config import Config
from megacpp.distributed.context import torchrun_world
from megacpp.distributed.join import agent_hosts_store
from megacpp.distributed.watchdog import LauncherWatch
from megacpp.train.autofit import attempt as autofit
from megacpp.train.autofit.attempt import AutoFitError, OomReport, next_micro_batch
from megacpp.train.autofit.child_output import ChildOutput
from megacpp.train.autofit.rendezvous import CLAIM_KEY, job_store, oom_key
from megacpp.train.config import TrainConfig
from megacpp.train.rundir import RunDirError, RunLock, claim_run_dir

if TYPE_CHECKING:
    from torch.distributed import Store

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
POLL_S = 0.2  # how often a supervisor looks for a peer's out-of-memory report while its child runs
KILL_GRACE_S = 10.0  # a child told to stop (SIGTERM) for a peer's retry is killed after this long


def wants_supervisor(cfg: Config, environ: dict[str, str] | None = None) -> bool:
    """Auto-fit applies: on, not already inside a supervised child, and training on CUDA."""
    env = os.environ if environ is None else environ
    if not cfg.train.oom_autofit or autofit.ATTEMPT_ENV in env:
        return False
    return trains_on_cuda(cfg.train.device)


def trains_on_cuda(device: str) -> bool:
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


@dataclass
class Job:
    """This supervisor's place in the job."""
    rank: int
    world_size: int
    out_dir: Path

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def log_path(self, attempt: int) -> Path:
        rank = f".rank{self.rank}" if self.distributed else ""
        return self.out_dir / "logs" / f"attempt{attempt}{rank}.log"

    def report_path(self, attempt: int) -> Path:
        rank = f".rank{self.rank}" if self.distributed else ""
        return self.out_dir / "logs" / f"attempt{attempt}{rank}.oom.json"


@dataclass
class Outcome:
    """How one attempt ended: the child's exit status, and the out-of-memory report that makes it a
    retry (this rank's, or a peer's under torchrun)."""
    status: int
    oom: OomReport | None
    interrupted: bool  # a signal was forwarded to the child: the user or torchrun is stopping the job
    output: ChildOutput


def supervise(cfg: Config, argv: Sequence[str], resume: bool) -> int:
    """Run `megacpp <argv>` (a train command) as supervised attempts; the exit status to leave with."""
    rank, world_size, _ = torchrun_world()
    job = Job(rank, world_size, Path(cfg.train.out_dir))
    # torchrun's agent killed leaves this supervisor orphaned, and its child (whose parent is still here)
    # would train on: the watch sends this process SIGTERM, which goes on to the child, which saves.
    watch = LauncherWatch(rank, "torchrun's agent") if job.distributed and "TORCHELASTIC_RUN_ID" in os.environ \
        else None
    store = _job_store(job, cfg.dist.init_timeout_s)
    lock = _claim(job, cfg, resume, store)
    try:
        return _attempts(job, cfg, list(argv), store)
    finally:
        if lock is not None:
            lock.release()
        if watch is not None:
            watch.close()


def _job_store(job: Job, timeout_s: float) -> Store | None:
    if not job.distributed:
        return None
    return job_store(timeout_s, host=job.rank == 0 and not agent_hosts_store())


def _claim(job: Job, cfg: Config, resume: bool, store: Store | None) -> RunLock | None:
    """Rank 0 claims the run directory (megacpp.train.rundir); every rank fails with its refusal."""
    lock, refusal = None, ""
    if job.rank == 0:
        try:
            lock = claim_run_dir(job.out_dir, resume, cfg.train.overwrite, _say)
        except RunDirError as exc:
            refusal = str(exc)
        except OSError as exc:
            refusal = f"train.out_dir {job.out_dir}: {exc.strerror or exc}: {exc.filename}"
        if store is not None:
            store.set(CLAIM_KEY, refusal)
    elif store is not None:
        refusal = store.get(CLAIM_KEY).decode()
    if refusal:
        raise RunDirError(refusal)
    return lock


@dataclass(frozen=True)
class Fit:
    """What an attempt runs with: the micro-batch (None: the configured one, or on --resume the
    checkpoint's) and whether auto-fit turned recompute on for every mixer."""
    micro: int | None = None
    recompute: bool = False

    def describe(self, micro: int) -> str:
        return f"{micro}" + (" with train.recompute all" if self.recompute else "")


def next_fit(tc: TrainConfig, fit: Fit, oom_micro: int) -> Fit | None:
    """The attempt after an out-of-memory error at micro-batch ``oom_micro``: half the micro-batch
    (`next_micro_batch`), except that recompute of every mixer comes first where the micro-batch would
    drop below 2 (or below the floor): it costs one more forward per step, a micro-batch of 1 leaves the
    GPU's kernels half idle. None when nothing is left to try."""
    recompute_on = fit.recompute or tc.recompute == "all"
    micro = next_micro_batch(tc.batch_size, oom_micro, tc.oom_min_micro_batch)
    if not recompute_on and (micro is None or micro < 2):
        return Fit(oom_micro, recompute=True)
    return None if micro is None else Fit(micro, fit.recompute)


def _attempts(job: Job, cfg: Config, argv: list[str], store: Store | None) -> int:
    tc = cfg.train
    fit = Fit()  # attempt 1: the child's own choice
    tried: list[str] = []
    attempt = 1
    while True:
        outcome = _run_attempt(job, attempt, fit, argv, store)
        if outcome.status == 0:
            return 0
        if outcome.oom is None or outcome.interrupted:
            _report_failure(job, attempt, outcome)
            return outcome.status
        oom = outcome.oom
        tried.append(fit.describe(oom.micro_batch))
        on_rank = f" on rank {oom.rank}" if job.distributed else ""
        following = next_fit(tc, fit, oom.micro_batch)
        if following is None:
            raise AutoFitError(
                f"out of memory in warmup at every micro-batch auto-fit tried ({', '.join(tried)}; "
                f"train.oom_min_micro_batch = {tc.oom_min_micro_batch}, train.batch_size {tc.batch_size}): step "
                f"{oom.step}{on_rank} ran out with {oom.memory}; lower data.seq_len, use more GPUs (dist.strategy "
                f"fsdp shards weights and optimizer state) or a smaller model (output: {job.log_path(attempt)})")
        fit = following
        how = " with every mixer's activations recomputed (train.recompute all)" if fit.recompute else ""
        _say(f"auto-fit: out of memory in warmup step {oom.step}{on_rank} at micro-batch {oom.micro_batch} "
             f"({oom.memory}); attempt {attempt + 1} runs micro-batch {fit.micro} x {tc.batch_size // fit.micro} per "
             f"batch of {tc.batch_size}{how} (global batch, token stream and schedule unchanged)")
        attempt += 1


def _run_attempt(job: Job, attempt: int, fit: Fit, argv: list[str], store: Store | None) -> Outcome:
    command = child_command(argv, fit)
    report_path = job.report_path(attempt)
    report_path.unlink(missing_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    with _ForwardSignals() as forwarding:  # before the child exists: no Ctrl-C may fall between the two
        proc = forwarding.child = subprocess.Popen(
            command, env=child_environment(os.environ, attempt, report_path), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        header = (f"=== megacpp auto-fit attempt {attempt} ({time.strftime('%Y-%m-%d %H:%M:%S')}), micro-batch "
                  f"{fit.micro if fit.micro is not None else 'as configured'}: {shlex.join(command)}")
        output = ChildOutput((proc.stdout, proc.stderr), (sys.stdout, sys.stderr), job.log_path(attempt), header)
        reports = PeerReports(store, attempt)
        peer_oom = _wait(proc, reports)
    _end_stragglers(proc.pid)
    output.close(_stopped_for(peer_oom, job.rank))
    status = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    oom = _read_report(report_path) or peer_oom or reports.get()
    return Outcome(status, oom, bool(forwarding.received), output)


def child_command(argv: Sequence[str], fit: Fit) -> list[str]:
    """The training process's command line: the user's arguments, and on a retry what auto-fit chose
    (last, so it wins over the user's own ``--train.micro_batch`` and ``--train.recompute``)."""
    retry = ["--train.micro_batch", str(fit.micro)] if fit.micro is not None else []
    if fit.recompute:
        retry += ["--train.recompute", "all"]
    return [sys.executable, "-m", "megacpp.cli", *argv, *retry]


def child_environment(environ: dict[str, str], attempt: int, report_path: Path) -> dict[str, str]:
    """The environment of attempt `attempt`'s training process (see the module docstring)."""
    env = dict(environ)
    env[autofit.ATTEMPT_ENV] = str(attempt)
    env[autofit.REPORT_ENV] = str(report_path)
    env[autofit.SPAWNED_ENV] = f"{time.time():.3f}"
    env[autofit.PARENT_ENV] = str(os.getpid())
    env["PYTHONUNBUFFERED"] = "1"  # print() into a pipe is block-buffered: lines would come late and out of order
    if attempt > 1:
        env["TORCH_DISTRIBUTED_DEBUG"] = "OFF"
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if sys.stderr.isatty():  # the child's streams are pipes: tell its progress bar the terminal's width
        size = shutil.get_terminal_size()
        env.setdefault("COLUMNS", str(size.columns))
        env.setdefault("LINES", str(size.lines))
    return env


class _ForwardSignals:
    """Within ``with``: SIGINT, SIGTERM and SIGHUP received here go to `child` (once it is set) and
    are listed in `received`."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def __enter__(self) -> _ForwardSignals:
        self._previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED_SIGNALS}
        return self

    def __exit__(self, *_exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _wait(proc: subprocess.Popen, reports: PeerReports) -> OomReport | None:
    """Wait for the child; under torchrun stop it as soon as a peer reports an out-of-memory error
    (SIGTERM, then SIGKILL after KILL_GRACE_S): it may be blocked in a collective for good."""
    peer: OomReport | None = None
    kill_at: float | None = None
    while True:
        try:
            proc.wait(timeout=POLL_S)
            return peer
        except subprocess.TimeoutExpired:
            pass
        if peer is None:
            peer = reports.get()
            if peer is not None:
                proc.terminate()
                kill_at = time.monotonic() + KILL_GRACE_S
        if kill_at is not None and time.monotonic() > kill_at:
            proc.kill()
            kill_at = None


def _stopped_for(peer: OomReport | None, rank: int) -> str:
    """The line that ends the log of a child stopped for a peer's out-of-memory error: without it the
    log would just stop, with no error of its own."""
    if peer is None or peer.rank == rank:  # this rank's own report: its child said it
        return ""
    return (f"=== stopped by the supervisor: rank {peer.rank} ran out of memory in warmup step {peer.step} at "
            f"micro-batch {peer.micro_batch}; every rank retries")


def _end_stragglers(pgid: int) -> None:
    """Kill what the child left behind in its process group (Inductor's compile workers, an autotune
    subprocess): they would hold its output pipes open and, on a GPU, memory the next attempt needs."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left of it: the usual case
        pass


class PeerReports:
    """A peer's out-of-memory report of one attempt, read from the job's store (None: one process)."""

    def __init__(self, store: Store | None, attempt: int) -> None:
        self.store = store
        self.key = oom_key(attempt)

    def get(self) -> OomReport | None:
        """The report, if a peer wrote one. A store that no longer answers (torchrun's agent, its host, was
        killed: the launcher watch stops this rank, and its child saves) has none to give, and is not asked
        again: c10d logs every failed request with its C++ stack trace, and the supervisor asks every POLL_S."""
        if self.store is None:
            return None
        try:
            return OomReport.from_json(self.store.get(self.key)) if self.store.check([self.key]) else None
        except RuntimeError:  # torch's DistStoreError is one
            self.store = None
            return None


def _read_report(path: Path) -> OomReport | None:
    try:
        return OomReport.from_json(path.read_text())
    except FileNotFoundError:
        return None


def _report_failure(job: Job, attempt: int, outcome: Outcome) -> None:
    """The end of a failed child's output, again, below everything else it printed."""
    if outcome.status in (130, 143) or (outcome.interrupted and outcome.status > 128):
        return  # Ctrl-C or SIGTERM (the child said what it saved), or a job being stopped: not a crash
    lines = outcome.output.tail()
    if explained_error(outcome.status, lines):
        return  # its one line is the last thing printed: once is enough
    _say(f"error: the training process (attempt {attempt}) failed ({_describe_status(outcome.status)}); the last "
         f"{len(lines)} lines of its "
         f"output follow (all of it: {outcome.output.log_path})")
    for line in lines:
        print(f"  | {line}", file=sys.stderr)
    sys.stderr.flush()


def explained_error(status: int, lines: list[str]) -> bool:
    """Whether a child's output ends with the one line of an error megacpp explains (megacpp.cli exits 1 or
    2 after it), with no traceback before it: not a crash, so nothing to show again."""
    printed = [line for line in lines if line.strip()]
    return (status in (1, 2) and bool(printed) and printed[-1].startswith("megacpp: ")
            and "error: " in printed[-1] and not any(line.startswith("Traceback") for line in printed))


def _describe_status(status: int) -> str:
    """``exit 1``, or ``killed by SIGKILL`` for a status of 128 + a signal's number."""
    try:
        return f"killed by {signal.Signals(status - 128).name}" if status > 128 else f"exit {status}"
    except ValueError:  # above 128 but no signal: an exit status the child chose
        return f"exit {status}"


def _say(message: str) -> None:
    print(f"megacpp: {message}", file=sys.stderr, flush=True)
