"""Where a step's time goes on each rank: compute, collectives and idle, from the torch profiler.

``train.profile_steps = N`` profiles N steps once warmup is over (from ``train.profile_from`` when set, else
from step `SETTLED_STEP` where the run is long enough, else as late as it allows, never before `FIRST_STEP`),
writes each rank's Chrome trace to ``<out_dir>/profile/rank<R>.trace.json`` (open it in Perfetto) and
one line per rank, gathered to rank 0's log and ``metrics.jsonl`` (kind "profile"):

    profile, steps 3-7, rank 0: 181.0 ms per step = compute 150.3 (83%) + exposed collectives 9.4 (5%)
    + idle 21.3 (12%); collectives 24.8 ms (AllReduce 16.1, AllGather 8.7), 62% hidden under compute

The line ends with the device time each optimizer's step launched ("optimizer steps: Muon 9.9 ms, AdamW
0.8 ms" of `small`'s 103 ms step on an H200: BENCHMARKS V9), found by following each kernel to the host
call that launched it. The device timeline is read from the trace's kernel events: NCCL kernels are
collectives, every other kernel, copy and memset is compute. Exposed collectives are collective time
with no compute kernel running beside it; idle is the step's wall time with no kernel at all (the host
was late, or a rank waited for its peers inside a collective that had not started). A scaling loss is
then a number with a cause, not a guess. On a CPU there are no device kernels, and the line says so.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megacpp.distributed.context import DistContext
from megacpp.train.metrics import MetricsLogger

FIRST_STEP = 3  # step 1 compiles the model, step 2 the optimizer's first compiled step
# Steps 3-5 of `small` on 2 H200s took 113 ms against a steady 73 ms (allocator growth, lazy inits):
# the window starts later where the run allows.
SETTLED_STEP = 10
COLLECTIVE_PREFIXES = ("nccl",)  # NCCL's kernels: ncclDevKernel_..., ncclKernel_...
BUSY_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# The host's CUDA API calls; the ones named *Synchronize are the host waiting for the device (a loss's
# .item(), an event). A step whose host seldom waits was launched no faster than the device ran it.
HOST_API_CATEGORIES = ("cuda_runtime", "cuda_driver")
# Kineto leaves CUPTI attached after a profile ends unless this variable is "1", and every kernel launch
# after it stays slower: on one H200 the 240 steps after a 3-step profile of `small` ran at 286k tokens/s,
# a run without a profile in the same call at 320k, and one with the variable set at 314k (BENCHMARKS A8).
CUPTI_TEARDOWN_VARIABLE = "TEARDOWN_CUPTI"


def is_host_wait(event: dict) -> bool:
    """Whether a trace event is the host blocked in a CUDA synchronization."""
    return event.get("cat") in HOST_API_CATEGORIES and "Synchronize" in str(event.get("name", ""))


@dataclass(frozen=True)
class StepSplit:
    """A rank's profiled steps, per step, in milliseconds."""
    rank: int
    first: int
    last: int
    wall_ms: float
    compute_ms: float
    exposed_collectives_ms: float
    idle_ms: float
    collectives_ms: float
    kernels: int
    # Collective time by NCCL operation ("AllGather", "ReduceScatter", "AllReduce", "SendRecv": the
    # all-to-all of expert parallelism is NCCL's grouped send/receive), each in ms per step.
    collectives_by_kind: dict[str, float] = field(default_factory=dict)
    host_wait_ms: float = 0.0  # the host blocked in CUDA synchronizations, per step
    # Device time launched inside each optimizer's step ("Muon.step": ms per step), largest first
    optimizer_ms: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        head = f"profile, steps {self.first}-{self.last}, rank {self.rank}: "
        if not self.kernels:
            return head + f"{self.wall_ms:.1f} ms per step; no device kernels in the trace (a CPU run)"
        hidden = 1 - self.exposed_collectives_ms / self.collectives_ms if self.collectives_ms else 1.0
        return (head + f"{self.wall_ms:.1f} ms per step = compute {self.compute_ms:.1f} "
                f"({self.compute_ms / self.wall_ms:.0%}) + exposed collectives {self.exposed_collectives_ms:.1f} "
                f"({self.exposed_collectives_ms / self.wall_ms:.0%}) + idle {self.idle_ms:.1f} "
                f"({self.idle_ms / self.wall_ms:.0%}); collectives {self.collectives_ms:.1f} ms{self._kinds()}, "
                f"{hidden:.0%} hidden under compute; the host waited for the device {self.host_wait_ms:.1f} ms"
                + self._optimizers())

    def _optimizers(self) -> str:
        steps = ", ".join(f"{name.removesuffix('.step')} {ms:.1f} ms" for name, ms in self.optimizer_ms.items())
        return f"; optimizer steps: {steps}" if steps else ""

    def _kinds(self) -> str:
        kinds = sorted(self.collectives_by_kind.items(), key=lambda kv: -kv[1])
        return f" ({', '.join(f'{kind} {ms:.1f}' for kind, ms in kinds)})" if kinds else ""


def union_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted, disjoint ones (touching intervals merge)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def device_time_by_launcher(events: list[dict]) -> dict[str, tuple[float, int]]:
    """Device time (us) and device events of a trace, by the host range that launched them, followed
    through the trace's correlation ids: "<Optimizer>.step" for what an optimizer's step (its
    ``Optimizer.step#...`` range on the launching thread; the innermost where ranges nest) launched, else
    "main thread" (the thread with the most kernel and graph launches) or "thread <tid>" (on CUDA the
    autograd engine runs the backward on a thread of its own), and "not traced" for events whose launch the
    trace does not hold."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in HOST_API_CATEGORIES and "correlation" in (e.get("args") or {})}
    steps_by_thread: dict[tuple, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("Optimizer.step#"):
            start = float(e["ts"])
            steps_by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(
                (start, start + float(e.get("dur", 0)), e["name"].split("#", 1)[1]))
    per_thread: dict[tuple, int] = {}
    for launch in launches.values():
        if "Launch" in str(launch.get("name", "")):  # kernel and graph launches, not copies or syncs
            thread = (launch.get("pid"), launch.get("tid"))
            per_thread[thread] = per_thread.get(thread, 0) + 1
    main = max(per_thread, key=per_thread.__getitem__, default=None)
    totals: dict[str, tuple[float, int]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in BUSY_CATEGORIES:
            continue
        launch = launches.get((e.get("args") or {}).get("correlation"))
        if launch is None:
            where = "not traced"
        else:
            thread, at = (launch.get("pid"), launch.get("tid")), float(launch["ts"])
            inside = [(start, name) for start, end, name in steps_by_thread.get(thread, []) if start <= at <= end]
            where = max(inside)[1] if inside else "main thread" if thread == main else f"thread {thread[1]}"
        us, count = totals.get(where, (0.0, 0))
        totals[where] = (us + float(e.get("dur", 0)), count + 1)
    return totals


def split_trace(events: list[dict], rank: int, first: int, last: int, wall_us: float) -> StepSplit:
    """The split of ``wall_us`` of profiled time (``last - first + 1`` steps) from a Chrome trace's events."""
    compute, collectives, host_wait = [], [], []
    by_kind: dict[str, list[tuple[float, float]]] = {}
    kernels = 0
    for event in events:
        if event.get("ph") != "X":
            continue
        span = (float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0)))
        if is_host_wait(event):
            host_wait.append(span)
        if event.get("cat") not in BUSY_CATEGORIES:
            continue
        kernels += 1
        is_collective = str(event.get("name", "")).lower().startswith(COLLECTIVE_PREFIXES)
        (collectives if is_collective else compute).append(span)
        if is_collective:
            by_kind.setdefault(collective_kind(str(event["name"])), []).append(span)
    compute_u, collectives_u = union_intervals(compute), union_intervals(collectives)
    busy = _length(union_intervals(compute_u + collectives_u))
    collective_us = _length(collectives_u)
    exposed = collective_us - _overlap(compute_u, collectives_u)
    per_step = 1000.0 * (last - first + 1)  # us over the window -> ms per step

    def ms(us: float) -> float:
        return us / per_step

    optimizers = sorted(((where, us) for where, (us, _) in device_time_by_launcher(events).items()
                         if where.endswith(".step")), key=lambda item: -item[1])
    return StepSplit(rank, first, last, ms(wall_us), ms(_length(compute_u)), ms(exposed),
                     ms(max(wall_us - busy, 0.0)), ms(collective_us), kernels,
                     {kind: ms(_length(union_intervals(spans))) for kind, spans in by_kind.items()},
                     ms(_length(union_intervals(host_wait))), {where: ms(us) for where, us in optimizers})


def collective_kind(kernel: str) -> str:
    """The NCCL operation of a collective kernel's name: "ncclDevKernel_AllGather_RING_LL" -> "AllGather"."""
    parts = kernel.split("_")
    return parts[1] if len(parts) > 1 else kernel


class StepProfiler:
    """Profiles ``steps`` consecutive steps of a run of ``total_steps`` (nothing when ``steps`` is 0) and
    reports every rank's split in rank 0's log and metrics."""

    def __init__(self, steps: int, total_steps: int, out_dir: Path, ctx: DistContext,
                 log: Callable[[str], None], start: int = 0) -> None:
        self.first = start or max(FIRST_STEP, min(SETTLED_STEP, total_steps - steps + 1))
        self.last = self.first + steps - 1
        self.active = steps > 0
        self.out_dir, self.ctx, self.log = out_dir, ctx, log
        self.rank, self.device = ctx.rank, ctx.device
        self._profiler: torch.profiler.profile | None = None
        self._t0 = 0.0

    def before_step(self, step: int) -> None:
        """``step`` (1-based) is about to run."""
        if self.active and step == self.first:
            self._detach_cupti_afterwards()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize(self.device)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
            self._t0 = time.perf_counter()

    def _detach_cupti_afterwards(self) -> None:
        """Ask Kineto to tear CUPTI down when the profile ends (read when it ends), unless the user chose."""
        chosen = os.environ.setdefault(CUPTI_TEARDOWN_VARIABLE, "1")
        if chosen != "1" and self.device.type == "cuda":
            self.log(f"{CUPTI_TEARDOWN_VARIABLE}={chosen} is set: CUPTI stays attached after the profile, and the "
                     f"steps after it run slower (about 10% on `small`); unset it to keep their speed")

    def after_step(self, step: int, metrics: MetricsLogger | None) -> StepSplit | None:
        """``step`` ran; once the last profiled step has, every rank's split goes to rank 0's log and
        ``metrics`` (every rank calls this: the splits are gathered), and this rank's is returned."""
        if self._profiler is None or step != self.last:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall_us = (time.perf_counter() - self._t0) * 1e6
        self._profiler.__exit__(None, None, None)
        path = self.out_dir / "profile" / f"rank{self.rank}.trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(path))
        self._profiler = None
        self.active = False
        events = json.loads(path.read_text()).get("traceEvents", [])
        split = split_trace(events, self.rank, self.first, self.last, wall_us)
        splits = self.ctx.all_gather_objects(split)
        for each in splits:
            self.log(each.line())
        if metrics is not None:
            metrics.log(step, "profile", {f"rank{s.rank}": asdict(s) for s in splits})
        return split
