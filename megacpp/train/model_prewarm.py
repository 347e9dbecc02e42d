"""The model's block graphs compiled by helper processes while the trainer compiles them in order.

A cold first step compiles the model region by region, one after the other in the trainer: `segments`,
then each block kind as the forward first reaches it, then the loss, then (lazily, in the backward) each
region's backward graph. `small` on an H100 spent 51-60 s on the forward and 16 s on the backward
(BENCHMARKS.md, K8). Each block kind's graphs depend only on the model's settings and the batch's shapes,
so a helper per block kind (and one for the loss) builds the model on the meta device, gives its own
blocks storage one at a time (small values: the graphs do not depend on them) and runs each forward and
backward on zero inputs of the trainer's shapes, under the trainer's compile settings, autocast and
warmup marking: the graphs land in the on-disk caches that the trainer's compile of the same regions then
reads. Each helper prints `FORWARD_READY` once its kind's forward graph is compiled, and the trainer's first
forward waits for that line before its first block of the kind (`ModelPrewarm.attach`): on one H100 (K9) the
trainer otherwise reached each kind first and compiled 3-5 of the 11 graphs itself, beside the helper
compiling the same graph.

Single-process and replicate runs only: fsdp and expert parallelism wrap the blocks in other graphs.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from megacpp.compile.config import CompileConfig
from megacpp.compile.entry import prepare_compile
from megacpp.compile.regions import compile_model
from megacpp.compile.workers import start_compile_workers
from megacpp.model.config import ModelConfig
from megacpp.model.hybrid import HybridLM
from megacpp.runtime.device import autocast_context
from megacpp.train.config import recompute_kinds
from megacpp.train.determinism import configure_mode
from megacpp.train.recompute import apply_recompute
from megacpp.train.step_prewarm import WAIT_TIMEOUT_S, HelperProcesses, helper_main, helper_report, start_helpers

# What a block kind's helper prints once that kind's forward graph is in the cache.
FORWARD_READY = "megacpp model helper: forward compiled"
POLL_S = 0.05  # how often the waiting trainer reads a helper's log (a compile takes seconds)


@dataclass(frozen=True)
class ModelJob:
    """What one helper compiles: the forward and backward of `blocks` (indices into the model's blocks),
    and the loss region if `loss`, at micro-batch `batch` x `seq_len`."""

    model: ModelConfig
    compile: CompileConfig
    deterministic: bool
    recompute: str
    device: str
    batch: int
    seq_len: int
    blocks: tuple[int, ...]
    loss: bool


def model_jobs(model: HybridLM, compile_cfg: CompileConfig, deterministic: bool, recompute: str,
               device: torch.device, batch: int, seq_len: int) -> dict[str, ModelJob]:
    """One job per block kind of `model`'s layout (named by its letter: every block of that kind, so each
    variant of the kind, as an Engram branch, is reached) and one for the loss region."""
    kinds: dict[str, list[int]] = {}
    for index, block in enumerate(model.blocks):
        kinds.setdefault(block.kind, []).append(index)

    def job(blocks: tuple[int, ...], loss: bool) -> ModelJob:
        return ModelJob(model.cfg, compile_cfg, deterministic, recompute, str(device), batch, seq_len, blocks, loss)

    jobs = {kind: job(tuple(indices), False) for kind, indices in kinds.items()}
    jobs["loss"] = job((), True)
    return jobs


def skip_reason(compile_cfg: CompileConfig, data_parallel: str, expert_parallel: int, retry: bool,
                local_rank: int) -> str | None:
    """Why no model helper starts for this process (None: they start, `compile.model_helper` being on).
    ``data_parallel``: the strategy's name ("single process", "replicate", ...). Under replicate every rank
    compiles the same graphs into its host's cache: local rank 0's helpers serve the others."""
    if compile_cfg.mode != "blocks":
        return f"compile.mode is {compile_cfg.mode}, not blocks"
    if data_parallel not in ("single process", "replicate") or expert_parallel > 1:
        return f"{data_parallel if expert_parallel <= 1 else 'expert parallelism'} wraps the blocks in other graphs"
    if retry:
        return "an auto-fit retry (memory is tight there)"
    if local_rank != 0:
        return "local rank 0's helpers fill this host's compile cache"
    return None


def _give_storage(module: nn.Module, device: torch.device) -> None:
    """Real storage for a meta-built module's parameters and buffers, filled with small values (a garbage
    value could make the routing of an E block or a soft-cap overflow; the graphs do not depend on them)."""
    module.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.02, generator=generator)
            else:
                tensor.zero_()


def run_job(job: ModelJob) -> float:
    """Compile `job`'s regions in this process as the trainer would compile them; their seconds."""
    configure_mode(job.deterministic)
    prepare_compile(job.compile)
    device = torch.device(job.device)
    start_compile_workers(job.compile, device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    with torch.device("meta"):
        model = HybridLM(job.model)
    apply_recompute(model, recompute_kinds(job.recompute))
    compile_model(model, job.compile, device)
    started = time.perf_counter()
    idx = torch.zeros(job.batch, job.seq_len, dtype=torch.int64, device=device)
    doc_ids = torch.zeros(job.batch, job.seq_len, dtype=torch.int32, device=device)  # the loader's, always given
    width = job.model.d_model
    with autocast_context(device):
        segments = model.segments(idx, doc_ids)
    for index in job.blocks:
        block = model.blocks[index]
        _give_storage(block, device)
        x = torch.zeros(job.batch, job.seq_len, width, device=device, requires_grad=True)
        with autocast_context(device):
            out = block(x, segments)
        if index == job.blocks[0]:  # the kind's forward graph is in the cache: the trainer may go on
            print(FORWARD_READY, flush=True)
        out.backward(torch.zeros_like(out))
        block.to_empty(device="meta")  # one block's storage at a time: an E block of nam52 is 1.0 GB in fp32
    if job.loss:
        for name, child in model.named_children():
            if name != "blocks":
                _give_storage(child, device)
        h = torch.zeros(job.batch, job.seq_len, width, device=device, requires_grad=True)
        with autocast_context(device):
            loss = model.loss(h, idx, segments)
        loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


class ModelPrewarm(HelperProcesses):
    """The model's helpers, one per job (`model_jobs`); `attach` makes the trainer's first forward wait for
    each kind's forward graph; after the first step `outcome` says what they did and stops those still
    compiling (they would only compete for the CPU)."""

    def __init__(self, processes: dict[str, subprocess.Popen], logs: dict[str, Path],
                 spec_dir: tempfile.TemporaryDirectory, first_blocks: dict[str, int]) -> None:
        super().__init__(processes, logs, spec_dir)
        self.first_blocks = first_blocks  # job -> the index of the first block its helper compiles
        self.waited_s: dict[str, float] = {}  # job -> how long the trainer's first forward waited for it
        self._hooks: list[RemovableHandle] = []

    @classmethod
    def start(cls, jobs: dict[str, ModelJob], log_dir: Path, suffix: str = "") -> ModelPrewarm:
        """Start a helper per job; output to ``log_dir/model_helper.<job><suffix>.log``."""
        return cls(*start_helpers(__name__, jobs, log_dir / "model_helper", suffix),
                   first_blocks={name: job.blocks[0] for name, job in jobs.items() if job.blocks})

    def wait_for_forward(self, name: str, timeout_s: float = WAIT_TIMEOUT_S) -> float:
        """Wait until job `name`'s helper printed `FORWARD_READY`, ended, or `timeout_s` passed; the seconds
        waited. Waiting costs the trainer nothing it would not spend: it would compile the same graph itself,
        later than the helper that started at once, and beside it on the same cores."""
        started = time.perf_counter()
        process, log = self.processes[name], self.logs[name]
        while time.perf_counter() - started < timeout_s:
            if FORWARD_READY in log.read_text(errors="replace") or process.poll() is not None:
                break
            time.sleep(POLL_S)
        return time.perf_counter() - started

    def attach(self, blocks: nn.ModuleList) -> None:
        """Before the first call of each job's first block, wait for that job's forward (once per job)."""
        for name, index in self.first_blocks.items():
            def wait_once(module: nn.Module, args: Any, name: str = name) -> None:
                if name not in self.waited_s:
                    self.waited_s[name] = self.wait_for_forward(name)
            self._hooks.append(blocks[index].register_forward_pre_hook(wait_once))

    def stop(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        super().stop()

    def outcome(self) -> str:
        """What each helper did by now, for the run log; stops those still running."""
        outcomes = []
        for name, process in self.processes.items():
            code = process.poll()
            if code is None:
                outcomes.append(f"{name} still compiling, stopped")
                continue
            report = helper_report(self.logs[name])
            outcomes.append(f"{name} {report['compiled_s']:.1f} s" if code == 0 and "compiled_s" in report
                            else f"{name} failed (exit {code}: {report.get('error', 'no report')}; "
                                 f"log: {self.logs[name]})")
        self.stop()
        waited = f"; the trainer waited {sum(self.waited_s.values()):.1f} s for their forwards" if self.waited_s else ""
        return f"model compiled beside the trainer by helper processes: {', '.join(outcomes)}{waited}"


def main(argv: list[str] | None = None) -> int:
    """`python -m megacpp.train.model_prewarm JOB_PICKLE TRAINER_PID`: compile the job, print its report."""
    return helper_main(sys.argv[1:] if argv is None else argv, lambda job: {
        "compiled_s": round(run_job(job), 2), "blocks": len(job.blocks), "loss": job.loss})


if __name__ == "__main__":
    # Run as the package's module, not as __main__: the job was pickled with that module's classes.
    from megacpp.train import model_prewarm

    sys.exit(model_prewarm.main())
