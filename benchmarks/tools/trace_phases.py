"""Where each compile's time went: per compile id of a ``TORCH_TRACE`` directory, the longest timed phases
(Dynamo's chromium events: tracing, AOTAutograd, Inductor's code generation, waiting on Triton compiles).

    TORCH_TRACE=/tmp/trace megacpp train --preset small ...
    python benchmarks/tools/trace_phases.py /tmp/trace
"""
import collections
import json
import sys
from pathlib import Path


def events(path: Path):
    lines = Path(path).read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if '"chromium_event"' not in line:
            continue
        payload = []
        while i < len(lines) and lines[i].startswith("\t"):
            payload.append(lines[i][1:])
            i += 1
        try:
            yield json.loads("\n".join(payload))
        except json.JSONDecodeError:
            pass


def main() -> None:
    for path in sorted(Path(sys.argv[1]).glob("*.log")):
        open_ = {}
        spans = collections.defaultdict(list)
        first_ts = None
        for ev in events(path):
            ts = ev.get("ts", 0) / 1e6
            first_ts = ts if first_ts is None else min(first_ts, ts)
            cid = (ev.get("args") or {}).get("compile_id", "-")
            key = (ev["name"], cid, ev.get("tid"))
            if ev.get("ph") == "B":
                open_.setdefault(key, []).append(ts)
            elif ev.get("ph") == "E" and open_.get(key):
                start = open_[key].pop()
                spans[cid].append((ev["name"], start - first_ts, ts - start))
            elif ev.get("ph") == "X":
                spans[cid].append((ev["name"], ts - first_ts, ev.get("dur", 0) / 1e6))
        print(f"== {path.name}")
        for cid, items in spans.items():
            total = max((d for _, _, d in items), default=0)
            if total < 0.5:
                continue
            start = min(s for _, s, _ in items)
            top = sorted(items, key=lambda x: -x[2])[:14]
            print(f"  compile {cid}: starts {start:.1f} s, longest {total:.1f} s")
            for name, s, d in top:
                if d >= 0.3:
                    print(f"    {name:48s} {d:7.2f} s  (at {s:.1f})")


if __name__ == "__main__":
    main()
