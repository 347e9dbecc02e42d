"""Where a profiled step's device time went, from a rank's Chrome trace (``train.profile_steps``): the
kernels by family (matmuls, attention, megacpp's own Triton kernels, Inductor's fused kernels, copies,
collectives) and by name, per profiled step, and the device's idle time split by gap length (many short
gaps are launch latency; a few long ones are the host doing something else).

    megacpp train ... --train.profile_steps 3
    python benchmarks/tools/device_kernels.py runs/x/profile/rank0.trace.json --steps 3 [--top 15]

Read it beside the profile line (compute + collectives + idle): this says which compute to attack first
and whether the idle is spread over the step or sits in one place. The last table gives each device event to
the host range that launched it (through the trace's correlation ids): each optimizer's step, else the
launching thread. On CUDA the autograd engine runs the backward on a thread of its own, so a plain run's
main thread holds the forward (with the loss and the loop's own work) and the other thread the backward.
"""
from __future__ import annotations

import argparse
import itertools
import re
from collections import defaultdict
from pathlib import Path

from host_timeline import load_events

from megacpp.train.profile import BUSY_CATEGORIES, device_time_by_launcher, union_intervals

# First match wins: name patterns of the kernels each family's libraries launch on Hopper.
FAMILIES = (
    ("collectives", re.compile(r"^nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|matmul|grouped_mm", re.I)),
    # megacpp's own kernels are module-private (`_fwd_scan_kernel`); C++ names mangled as `_Z...` are not its
    ("megacpp triton", re.compile(r"^_(?!Z)")),
    ("inductor triton", re.compile(r"^triton_")),
    ("copies and fills", re.compile(r"memcpy|memset|copy|fill", re.I)),
)
GAP_BUCKETS_US = (10.0, 100.0, 1000.0)  # idle gaps shorter than 10 µs, 10-100, 100-1000, longer


def family(name: str) -> str:
    """The family a kernel name belongs to ("other" when no pattern matches)."""
    for fam, pattern in FAMILIES:
        if pattern.search(name):
            return fam
    return "other"


def device_events(events: list[dict]) -> list[dict]:
    """The trace's device-side events: kernels, copies, fills."""
    return [e for e in events if e.get("cat") in BUSY_CATEGORIES]


def kernel_table(device: list[dict], steps: int) -> dict:
    """Milliseconds per step by family and by kernel name, and the idle gaps between device events (the
    union of busy intervals subtracted from the span of the first to the last event) bucketed by length."""
    by_family: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in device:
        dur = float(e.get("dur", 0))
        by_family[family(e["name"])] += dur
        by_name[e["name"]][0] += dur
        by_name[e["name"]][1] += 1
    busy = union_intervals((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in device)
    gaps = [start - end for (_, end), (start, _) in itertools.pairwise(busy)]
    edges = (0.0, *GAP_BUCKETS_US, float("inf"))
    buckets = [{"from_us": lo, "to_us": hi, "count": sum(lo <= g < hi for g in gaps) / steps,
                "ms": sum(g for g in gaps if lo <= g < hi) / 1000.0 / steps} for lo, hi in itertools.pairwise(edges)]
    return {
        "families": sorted(((f, t / 1000.0 / steps) for f, t in by_family.items()), key=lambda x: -x[1]),
        "kernels": sorted(((n, t / 1000.0 / steps, c / steps) for n, (t, c) in by_name.items()), key=lambda x: -x[1]),
        "gaps": buckets,
    }


def launch_ranges(events: list[dict], steps: int) -> list[tuple[str, float, float]]:
    """(where, device ms per step, device events per step) for each host range that launched device work
    (`megacpp.train.profile.device_time_by_launcher`), largest first."""
    totals = device_time_by_launcher(events)
    return sorted(((w, us / 1000.0 / steps, n / steps) for w, (us, n) in totals.items()), key=lambda x: -x[1])


def render(table: dict, top: int) -> str:
    busy = sum(ms for _, ms in table["families"])
    lines = [f"device busy {busy:.2f} ms per step, by family:"]
    lines += [f"  {ms:8.2f} ms  {100 * ms / busy:5.1f}%  {fam}" for fam, ms in table["families"]]
    lines.append(f"top {top} kernels (ms per step, launches per step):")
    lines += [f"  {ms:8.3f} ms  {count:6.1f}x  {name[:110]}" for name, ms, count in table["kernels"][:top]]
    lines.append("idle gaps between device events, per step:")
    for b in table["gaps"]:
        span = f"over {b['from_us']:.0f}" if b["to_us"] == float("inf") else f"{b['from_us']:.0f}-{b['to_us']:.0f}"
        lines.append(f"  {span} µs: {b['count']:.1f} gaps, {b['ms']:.2f} ms")
    if table.get("launched_by"):
        lines.append("device time by the host range that launched it, per step:")
        lines += [f"  {ms:8.2f} ms  {count:7.1f} events  {where}" for where, ms, count in table["launched_by"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a rank's trace: <out_dir>/profile/rank<R>.trace.json (or .gz)")
    parser.add_argument("--steps", type=int, default=1, help="steps the trace holds, to give figures per step")
    parser.add_argument("--top", type=int, default=15, help="kernel names to list (default 15)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if not args.trace.is_file():
        parser.error(f"{args.trace}: no such trace file (a run with --train.profile_steps N writes "
                     "<out_dir>/profile/rank<R>.trace.json)")
    events = load_events(args.trace)
    table = kernel_table(device_events(events), args.steps)
    table["launched_by"] = launch_ranges(events, args.steps)
    print(render(table, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
