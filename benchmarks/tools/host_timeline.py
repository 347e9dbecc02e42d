"""Where a profiled step's host time went, from a rank's Chrome trace (``train.profile_steps``): when the
main thread launched the forward, when the autograd thread ran the backward, when each optimizer stepped,
how long the host waited for the device, and the record_function ranges (FSDP2's hooks, the optimizers'
steps, NCCL calls) that took most of the host's time.

    megacpp train ... --train.profile_steps 1
    python benchmarks/tools/host_timeline.py runs/x/profile/rank0.trace.json [--top 12]

Read it beside the profile line: a rank whose GPU idles while its host seldom waited is host-bound, and
these spans say which phase's launches took the time (BENCHMARKS.md, D20: FSDP2 on `small`).
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path

from megacpp.train.profile import is_host_wait

HOST_CATEGORIES = ("cpu_op", "user_annotation")


def load_events(path: Path) -> list[dict]:
    """The complete ("X") events of a trace file, gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]


def host_timeline(events: list[dict]) -> dict:
    """Spans in ms from the trace's first host event: the main thread's (most host events) and the other
    host threads' first and last events, each ``Optimizer.step#...`` range, the host's wait in CUDA
    synchronizations, and every record_function name's count and total duration (FSDP2 names its ranges
    per module, "FSDP::pre_forward (blocks.12)": counted under "FSDP::pre_forward")."""
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    if not host:
        raise ValueError("the trace has no host events (was it profiled with the CPU activity?)")
    t0 = min(float(e["ts"]) for e in host)

    def ms(us: float) -> float:
        return (us - t0) / 1000.0

    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in host:
        by_thread[(e["pid"], e["tid"])].append(e)
    threads = sorted(by_thread, key=lambda t: -len(by_thread[t]))
    spans = [{"thread": "main" if i == 0 else f"thread {t[1]}", "events": len(by_thread[t]),
              "first_ms": ms(min(float(e["ts"]) for e in by_thread[t])),
              "last_ms": ms(max(float(e["ts"]) + float(e.get("dur", 0)) for e in by_thread[t]))}
             for i, t in enumerate(threads)]
    steps = [{"name": e["name"], "start_ms": ms(float(e["ts"])), "dur_ms": float(e.get("dur", 0)) / 1000.0}
             for e in sorted(host, key=lambda e: float(e["ts"]))
             if e.get("cat") == "user_annotation" and e["name"].startswith("Optimizer.step#")]
    wait = sum(float(e.get("dur", 0)) for e in events if is_host_wait(e)) / 1000.0
    counts: Counter = Counter()
    totals: dict[str, float] = defaultdict(float)
    for e in host:
        if e.get("cat") == "user_annotation":
            name = e["name"].split(" (")[0]
            counts[name] += 1
            totals[name] += float(e.get("dur", 0)) / 1000.0
    annotations = sorted(({"name": n, "count": counts[n], "total_ms": totals[n]} for n in counts),
                         key=lambda a: -a["total_ms"])
    return {"threads": spans, "optimizer_steps": steps, "host_wait_ms": wait, "annotations": annotations}


def render(timeline: dict, top: int) -> str:
    lines = [f"{s['thread']}: {s['first_ms']:.1f} - {s['last_ms']:.1f} ms ({s['events']} events)"
             for s in timeline["threads"]]
    lines += [f"{s['name']}: from {s['start_ms']:.1f} ms, {s['dur_ms']:.1f} ms" for s in timeline["optimizer_steps"]]
    lines.append(f"the host waited for the device {timeline['host_wait_ms']:.1f} ms")
    lines.append(f"record_function ranges by host time, nested ones counted in each (top {top}):")
    lines += [f"  {a['total_ms']:8.1f} ms  {a['count']:4d}x  {a['name']}" for a in timeline["annotations"][:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a rank's trace: <out_dir>/profile/rank<R>.trace.json (or .gz)")
    parser.add_argument("--top", type=int, default=12, help="record_function names to list (default 12)")
    args = parser.parse_args(argv)
    print(render(host_timeline(load_events(args.trace)), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
