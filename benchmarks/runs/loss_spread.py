"""Step-to-step spread of the training loss and gradient-norm spikes of finished runs (issue 13's
before/after comparison of the loader).

    python benchmarks/runs/loss_spread.py before=/tmp/before after=/tmp/after --steps 100:300

Over the steps in the window, from each run's metrics.jsonl:
- detrended std: standard deviation of the loss minus its least-squares line over the window;
- diff std and diff range: standard deviation, and max - min, of loss[s] - loss[s-1];
- grad norm: median and maximum, and spikes = steps whose norm exceeds 3x the window's median;
  for runs that log per-part norms, which part (block kind, embedding, head, ...) was largest at them,
  and for runs that log per-block norms, where each spike starts: the topmost block whose norm exceeds
  10x its median over the window (a backward that blows up at one block inflates every block below it).
The loss at a step is one batch's loss, so these measure how much batches differ from each other.
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np
from run_dirs import parse_run_arg, run_metrics, step_window

from megacpp.train.grad_norms import median_block_norms, spike_starts

PART_PREFIX = "grad_norm_"  # the per-part norms of megacpp.train.grad_norms


def spread(path: Path, first: int, last: int) -> dict[str, float]:
    records = [r for r in run_metrics(path)
               if r["kind"] == "train" and first <= r["step"] <= last]
    if len(records) < 3:
        raise SystemExit(f"{path}: fewer than 3 training records in steps {first}..{last}")
    steps = np.array([r["step"] for r in records], dtype=np.float64)
    loss = np.array([r["loss"] for r in records])
    trend = np.polyval(np.polyfit(steps, loss, 1), steps)
    diffs = np.diff(loss)
    out = {"steps": len(loss), "mean loss": loss.mean(), "detrended std": (loss - trend).std(),
           "diff std": diffs.std(), "diff range": diffs.max() - diffs.min()}
    with_norm = [r for r in records if "grad_norm" in r]
    norms = np.array([r["grad_norm"] for r in with_norm])
    if len(norms):
        median = float(np.median(norms))
        spikes = [r for r in with_norm if r["grad_norm"] > 3 * median]
        out.update({"grad norm median": median, "grad norm max": norms.max(), "spikes > 3x median": len(spikes)})
        if any(PART_PREFIX in key for key in with_norm[0]):
            out["largest part at spikes"] = largest_parts(spikes)
        if "block_grad_norms" in with_norm[0]:
            out["spikes start at"] = spike_origins(with_norm, spikes)
    return out


def spike_origins(records: list[dict], spikes: list[dict]) -> str:
    """How often each block was the topmost inflated one at a spike, e.g. "11R 3, 7M 1"."""
    typical = median_block_norms(r["block_grad_norms"] for r in records)
    counts = spike_starts((r["block_grad_norms"] for r in spikes), typical)
    return ", ".join(f"{label or 'none'} {n}" for label, n in counts.most_common()) or "-"


def largest_parts(records: list[dict]) -> str:
    """How often each part (grad_norm_<part>, runs since per-part norms) had the largest norm, e.g. "R 5, M 1"."""
    counts = Counter(max((k for k in r if k.startswith(PART_PREFIX)), key=r.__getitem__)[len(PART_PREFIX):]
                     for r in records)
    return ", ".join(f"{part} {n}" for part, n in counts.most_common()) or "-"


def spread_table(rows: list[tuple[str, dict]]) -> str:
    """A markdown table of (label, spread(...)) rows."""
    keys = list(rows[0][1])
    lines = ["| run | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for label, figures in rows:
        cells = [f"{figures[k]:.4f}" if isinstance(figures.get(k), float) else str(figures.get(k, "-"))
                 for k in keys]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories, optionally label=dir")
    parser.add_argument("--steps", default="100:300", help="first:last step of the window (inclusive)")
    args = parser.parse_args()
    first, last = step_window(args.steps, "--steps")
    rows = [(label, spread(path, first, last)) for label, path in map(parse_run_arg, args.runs)]
    print(f"steps {first}..{last}")
    print(spread_table(rows))


if __name__ == "__main__":
    main()
