"""The optimizer step compiled by helper processes while the trainer compiles the model.

A cold first step compiles the model (forward, then backward) and then the optimizer step, one after the
other in one process: `small` on an H100 spent 62 + 12 s on the model and 82 s on the step (`muon_step`
58 s, `adamw_step` 18 s; BENCHMARKS.md, compilation). The step's graphs depend only on the layouts of
the parameters and of their state, known before the first forward. So a helper process per optimizer
compiles its calls from a description (shapes, strides, offsets, dtypes, aliasing: no values) into the
on-disk caches the trainer uses (FX graph, AOTAutograd, Triton), while the trainer compiles the model;
the trainer's own compile of the step, at the end of the first step, then loads from those caches.

A helper repeats what the trainer set that enters the cache keys (the run mode and the compile settings:
`configure_mode`, `prepare_compile`), runs the calls in the step's order under no_grad as the step does,
and holds a zeroed copy of each call's tensors on the device while it compiles it: `auto` starts the
helpers on CUDA only when those copies are at most a tenth of the card. A description that misses the
cache costs only the helpers' time: the step compiles itself, as it did before.

Once a run's first optimizer step has compiled, the trainer marks each helper job's key (`job_key`: its
description, settings, torch, Triton and megacpp's source) in the compile cache, and `auto` starts no
helper for a marked job: with the cache warm, the helpers' start (imports, CUDA, loading the graphs) made
`small`'s first step wait 16 s and last 34.3 s against 17.9 s without them (H100).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from megacpp.compile.cache import current_cache_dir, package_source_digest
from megacpp.compile.config import CompileConfig
from megacpp.compile.entry import prepare_compile
from megacpp.compile.workers import start_compile_workers
from megacpp.optim.hparams import StepCall
from megacpp.optim.muon import STEP_PARTS
from megacpp.train.autofit.attempt import die_with_parent
from megacpp.train.determinism import configure_mode
from megacpp.versions import package_version, torch_version

# `auto` starts the helpers only when their copies of the step's tensors are at most this share of the card:
# the trainer's first forward runs beside it.
HELPER_MEMORY_SHARE = 0.10
WAIT_TIMEOUT_S = 1800.0  # longer than any cold compile measured (nam52's step: 98 s): a hung helper is killed
# A Muon step compiles as several graphs (`optim.muon.STEP_PARTS`): each its own helper, side by side.
HELPERS_PER_OPTIMIZER = len(STEP_PARTS)
MARKS_DIR = "megacpp-step-prewarm"  # under the Inductor cache directory: one empty file per compiled job key


@dataclass(frozen=True)
class TensorSpec:
    """What a compiled graph keys on of an input tensor. device None: the call's device (a stand-in).
    identity: equal for every place one tensor object fills (a group's lr in each of its buckets): the
    graph takes it once, so the copy must be one tensor there too. base: equal for inputs that are views
    of one storage (`ShardedMuon`'s per-row second moments, views of the rows it gathered), which the
    graph treats as aliases; their copies are views of one zeroed storage of `storage` elements."""

    identity: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str | None
    parameter: bool
    offset: int = 0
    base: int | None = None
    storage: int = 0

    @property
    def extent(self) -> int:
        """Elements from the first to one past the last this tensor reaches, from its offset."""
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True)) if all(self.shape) else 0


def map_tensors(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """`value` with `leaf` applied to every tensor or spec, through lists and plain tuples (named tuples,
    like a Muon bucket's plan, are constants of the graph and kept as they are)."""
    if isinstance(value, (Tensor, TensorSpec)):
        return leaf(value)
    if isinstance(value, list):
        return [map_tensors(v, leaf) for v in value]
    if type(value) is tuple:
        return tuple(map_tensors(v, leaf) for v in value)
    return value


def describe(value: Any) -> Any:
    """`value` with every tensor replaced by its `TensorSpec`."""
    tensors: dict[int, Tensor] = {}
    map_tensors(value, lambda t: tensors.setdefault(id(t), t))
    roots: dict[int, list[Tensor]] = {}  # storage root -> the distinct inputs viewing it
    for t in tensors.values():
        roots.setdefault(id(t._base if t._base is not None else t), []).append(t)
    bases = {id(t): (index, t.untyped_storage().nbytes() // t.element_size())
             for index, group in enumerate(g for g in roots.values() if len(g) > 1) for t in group}
    specs: dict[int, TensorSpec] = {}
    for t in tensors.values():
        base, storage = bases.get(id(t), (None, 0))
        specs[id(t)] = TensorSpec(len(specs), tuple(t.shape), tuple(t.stride()), t.dtype,
                                  None if t.device.type == "meta" else str(t.device), isinstance(t, nn.Parameter),
                                  t.storage_offset(), base, storage)
    return map_tensors(value, lambda t: specs[id(t)])


def materialize(value: Any, device: torch.device) -> Any:
    """`describe`'s inverse: fresh zeroed tensors of each spec's layout (parameters as nn.Parameter), one
    per identity, aliases as views of one storage."""
    made: dict[int, Tensor] = {}
    storages: dict[int, Tensor] = {}

    def make(spec: TensorSpec) -> Tensor:
        if spec.identity in made:
            return made[spec.identity]
        where = spec.device or device
        if spec.base is not None:
            if spec.base not in storages:
                storages[spec.base] = torch.zeros(spec.storage, dtype=spec.dtype, device=where)
            tensor = storages[spec.base].as_strided(spec.shape, spec.stride, spec.offset)
        elif spec.offset:
            flat = torch.zeros(spec.offset + spec.extent, dtype=spec.dtype, device=where)
            tensor = flat.as_strided(spec.shape, spec.stride, spec.offset)
        else:
            tensor = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=where).zero_()
        made[spec.identity] = nn.Parameter(tensor) if spec.parameter else tensor
        return made[spec.identity]

    return map_tensors(value, make)


def spec_bytes(value: Any) -> int:
    """Device bytes `materialize` allocates for `value`."""
    specs: dict[int, TensorSpec] = {}
    map_tensors(value, lambda spec: specs.setdefault(spec.identity, spec))
    shared = {spec.base: spec.storage * spec.dtype.itemsize for spec in specs.values() if spec.base is not None}
    alone = sum((spec.offset + spec.extent) * spec.dtype.itemsize for spec in specs.values() if spec.base is None)
    return alone + sum(shared.values())


@dataclass(frozen=True)
class HelperJob:
    """What one helper process reads: an optimizer's calls to compile, in the step's order, and the
    settings that key their caches."""

    calls: tuple[StepCall, ...]  # args described
    device: str
    deterministic: bool
    compile: CompileConfig


def helper_jobs(calls: dict[str, list[StepCall]], device: torch.device, deterministic: bool,
                compile_cfg: CompileConfig, per_optimizer: int = HELPERS_PER_OPTIMIZER) -> dict[str, HelperJob]:
    """The helpers' jobs: each optimizer's calls (`OptimizerStack.first_step_calls`) described, shared out
    over up to `per_optimizer` jobs (``muon.1``, ``muon.2``; an optimizer of one call keeps its name)."""
    jobs = {}
    for name, made in calls.items():
        shares = _share_out([c._replace(args=describe(c.args)) for c in made], per_optimizer)
        for index, share in enumerate(shares, 1):
            jobs[name if len(shares) == 1 else f"{name}.{index}"] = HelperJob(share, str(device), deterministic,
                                                                              compile_cfg)
    return jobs


def _share_out(calls: list[StepCall], count: int) -> list[tuple[StepCall, ...]]:
    """`calls` over at most `count` shares of about equal size (a graph's compile time follows its size,
    counted in input tensors), largest first to the lightest share; each share in step order."""
    sizes = [_tensor_count(c.args) for c in calls]
    load = [0] * min(count, len(calls))
    owner: dict[int, int] = {}
    for index in sorted(range(len(calls)), key=lambda i: -sizes[i]):
        lightest = load.index(min(load))
        owner[index] = lightest
        load[lightest] += sizes[index]
    return [tuple(c for i, c in enumerate(calls) if owner[i] == share) for share in range(len(load))]


def _tensor_count(value: Any) -> int:
    found: list[TensorSpec] = []
    map_tensors(value, found.append)
    return len(found)


def job_key(job: HelperJob) -> str:
    """What `job`'s graphs depend on, hashed: its calls' descriptions, device and mode, the compile
    settings (less those that choose no graph: the helper setting, where the cache lives), torch's and
    Triton's versions and megacpp's source. Equal keys compile equal graphs."""
    settings = dataclasses.asdict(job.compile)
    for name in ("optimizer_helper", "model_helper", "cache_dir", "import_cache"):
        settings.pop(name)
    content = pickle.dumps((job.calls, job.device, job.deterministic, sorted(settings.items()),
                            str(torch_version()), package_version("triton"), package_source_digest()))
    return hashlib.sha256(content).hexdigest()[:32]


def _mark(job: HelperJob) -> Path:
    return current_cache_dir() / MARKS_DIR / job_key(job)


def is_compiled(job: HelperJob) -> bool:
    """Whether a run with this cache marked `job`'s key: its graphs are in the cache."""
    return _mark(job).exists()


def mark_compiled(jobs: dict[str, HelperJob]) -> str | None:
    """After the first optimizer step compiled: mark each job's key in the cache. None, or why a mark
    could not be written (the run goes on: a later run's helpers then compile again)."""
    try:
        for job in jobs.values():
            mark = _mark(job)
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
    except OSError as exc:
        return f"optimizer helper: could not mark the step's graphs as compiled ({exc})"
    return None


def skip_reason(setting: str, jobs: dict[str, HelperJob], device: torch.device, retry: bool = False) -> str | None:
    """Why no helper starts under `compile.optimizer_helper = setting` (None: they start). `jobs`: each
    optimizer's (`helper_jobs`). `retry`: this process is an auto-fit retry, after an attempt ran out of
    memory. `auto` starts helpers only for the jobs not `is_compiled` (`StepPrewarm.start`'s caller picks)."""
    if setting == "off":
        return "compile.optimizer_helper is off"
    if not jobs:
        return "the optimizer step is not compiled"
    if setting == "on":
        return None
    if retry:  # the memory is tight: no copy of the step's tensors beside the retry's
        return "auto leaves them out of an auto-fit retry"
    if all(is_compiled(job) for job in jobs.values()):
        return "an earlier run put the step's graphs in the compile cache"
    if device.type != "cuda":
        return f"auto starts them on CUDA only (device {device})"
    # A helper's copies live for one call each (its calls run one after the other); the helpers side by side.
    need = sum(max(spec_bytes(c.args) for c in job.calls) for job in jobs.values())
    card = torch.cuda.get_device_properties(device).total_memory
    if need > HELPER_MEMORY_SHARE * card:
        return (f"their copy of the step's tensors ({need / 2**30:.1f} GiB) is more than "
                f"{HELPER_MEMORY_SHARE:.0%} of the card ({card / 2**30:.0f} GiB)")
    return None


class HelperProcesses:
    """Helper processes that `start_helpers` started, one per job, compiling side by side."""

    def __init__(self, processes: dict[str, subprocess.Popen], logs: dict[str, Path],
                 spec_dir: tempfile.TemporaryDirectory) -> None:
        self.processes = processes
        self.logs = logs
        self._spec_dir = spec_dir

    def stop(self) -> None:
        """End the helpers that still run (the run stopped before it needed them, or no longer needs them)."""
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        self._spec_dir.cleanup()


class StepPrewarm(HelperProcesses):
    """The optimizer's helpers, one per job (`helper_jobs`); `wait` for them before the first optimizer step."""

    def __init__(self, processes: dict[str, subprocess.Popen], logs: dict[str, Path],
                 spec_dir: tempfile.TemporaryDirectory) -> None:
        super().__init__(processes, logs, spec_dir)
        self._cache_counts: tuple[int, int] | None = None

    @classmethod
    def start(cls, jobs: dict[str, HelperJob], log_dir: Path, suffix: str = "") -> StepPrewarm:
        """Start a helper for each optimizer's job (`helper_jobs`); helper output goes to
        ``log_dir/optimizer_helper.<optimizer><suffix>.log``."""
        return cls(*start_helpers(__name__, jobs, log_dir / "optimizer_helper", suffix))

    def wait(self, timeout_s: float = WAIT_TIMEOUT_S) -> str:
        """Wait for the helpers (stopping them after `timeout_s`); a line for the run log. `cache_line`
        after the step says whether the step's compile found the helpers' graphs."""
        began = time.perf_counter()
        outcomes = []
        try:
            for name, process in self.processes.items():
                left = max(0.0, timeout_s - (time.perf_counter() - began))
                try:
                    code = process.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    outcomes.append(f"{name} still compiling after {timeout_s:.0f} s, stopped (log: {self.logs[name]})")
                    continue
                log = self.logs[name]
                report = helper_report(log)
                if code == 0 and "compiled_s" in report:
                    calls = report["calls"]
                    outcomes.append(f"{name} {report['compiled_s']:.1f} s ({calls} call{'s' * (calls != 1)})")
                else:
                    outcomes.append(f"{name} failed (exit {code}: {report.get('error', 'no report')}; log: {log})")
        finally:
            self.stop()
        self._cache_counts = fx_cache_counts()
        return (f"optimizer step compiled beside the model by helper processes: {', '.join(outcomes)}; "
                f"the step waited {time.perf_counter() - began:.1f} s for them")

    def cache_line(self) -> str:
        """After the first step: how many of the step's graphs came from the cache the helpers filled."""
        if self._cache_counts is None:
            return ""
        hits, misses = (now - before for now, before in zip(fx_cache_counts(), self._cache_counts, strict=True))
        return f"optimizer step graphs from the helpers' cache: {hits} of {hits + misses}"


def start_helpers(module: str, jobs: dict[str, Any], log_stem: Path, suffix: str = ""
                  ) -> tuple[dict[str, subprocess.Popen], dict[str, Path], tempfile.TemporaryDirectory]:
    """``python -m module JOB_PICKLE TRAINER_PID`` per job, output to ``<log_stem>.<name><suffix>.log``: the
    processes, their logs, and the directory of the pickled jobs (to clean up once they ended)."""
    spec_dir = tempfile.TemporaryDirectory(prefix="megacpp-helper-")
    log_stem.parent.mkdir(parents=True, exist_ok=True)
    # The helpers import this very megacpp, whatever put it on this process's path.
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    processes, logs = {}, {}
    for name, job in jobs.items():
        spec = Path(spec_dir.name) / f"{name}.pkl"
        spec.write_bytes(pickle.dumps(job))
        logs[name] = log_stem.with_name(f"{log_stem.name}.{name}{suffix}.log")
        with open(logs[name], "w") as log:
            processes[name] = subprocess.Popen([sys.executable, "-m", module, str(spec), str(os.getpid())],
                                               stdout=log, stderr=subprocess.STDOUT, env=env)
    return processes, logs, spec_dir


def helper_report(log: Path) -> dict[str, Any]:
    """The JSON line a helper ends with: {"compiled_s": seconds, ...} or {"error": its exception}."""
    lines = log.read_text(errors="replace").splitlines()
    return next((json.loads(x) for x in reversed(lines) if x.startswith(('{"compiled_s"', '{"error"'))), {})


def fx_cache_counts() -> tuple[int, int]:
    counters = torch._dynamo.utils.counters["inductor"]
    return counters["fxgraph_cache_hit"], counters["fxgraph_cache_miss"]


def run_job(job: HelperJob) -> float:
    """Compile `job`'s calls in this process, in order, with the trainer's settings (one compiled wrapper
    per function, as `TensorHParamOptimizer._run` keeps); their seconds."""
    configure_mode(job.deterministic)
    prepare_compile(job.compile)
    device = torch.device(job.device)
    start_compile_workers(job.compile, device)  # up while the calls' copies are made
    if device.type == "cuda" and device.index is not None:  # "cuda" alone: the current device, as in the trainer
        torch.cuda.set_device(device)
    compiled: dict[Any, Any] = {}
    started = time.perf_counter()
    with torch.no_grad():
        for call in job.calls:
            if call.fn not in compiled:
                compiled[call.fn] = torch.compile(call.fn, fullgraph=True, backend=call.backend)
            compiled[call.fn](*materialize(call.args, device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    """`python -m megacpp.train.step_prewarm JOB_PICKLE TRAINER_PID`: compile the job, print its report."""
    return helper_main(sys.argv[1:] if argv is None else argv, lambda job: {
        "compiled_s": round(run_job(job), 2), "calls": len(job.calls)})


def helper_main(argv: list[str], run: Callable[[Any], dict[str, Any]]) -> int:
    """A helper process's body: ``argv`` = JOB_PICKLE TRAINER_PID; `run` compiles the job and returns its
    report (``compiled_s`` first), printed as the log's last line; an exception's innermost cause is."""
    spec, trainer = argv
    die_with_parent(int(trainer))  # a helper outliving its trainer would hold GPU memory for nothing
    try:
        report = run(pickle.loads(Path(spec).read_bytes()))
    except Exception as exc:
        traceback.print_exc()
        root = exc  # Dynamo wraps an error raised while tracing: the innermost one names what happened
        while (root.__cause__ or root.__context__) is not None:
            root = root.__cause__ or root.__context__
        first = (str(root).strip().splitlines() or [""])[0]
        print(json.dumps({"error": f"{type(root).__name__}: {first}"[:300]}), flush=True)
        return 1
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    # Run as the package's module, not as __main__: the job was pickled with that module's classes.
    from megacpp.train import step_prewarm

    sys.exit(step_prewarm.main())
