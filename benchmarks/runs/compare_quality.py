"""Compare finished runs' validation bits per byte: against tokens trained and against wall time,
with the baselines (xz -9e alone and given the training split, unigram entropy) as horizontal lines.

    python benchmarks/runs/compare_quality.py runs/small runs/dense --out quality.png
    python benchmarks/runs/compare_quality.py small=runs/small dense=/tmp/d --out quality.png

Each argument is a run directory (its metrics.jsonl is read), optionally labelled `label=dir`. Runs
must have been trained by a megacpp with issue 13's metrics (val records with `tokens` and
`elapsed_s`, a `baselines` record). Prints one row per run: the best and the last validation figure
with the tokens and seconds to reach them, and the baselines (the same for runs on the same data).
Then the runs side by side at equal budgets: each run's last evaluation within the token count, and
within the training time, of the run that got least far. Training time is wall time after the first
step (its compilation differs between models and is not what is compared); evaluations count.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from run_dirs import parse_run_arg, run_metrics  # noqa: E402

from megacpp.train.metrics import BASELINE_LINES, baselines_of  # noqa: E402


@dataclass
class Run:
    label: str
    tokens: list[int]
    seconds: list[float]
    bpb: list[float]
    baselines: dict | None
    first_step_s: float  # wall time at the end of step 1 (compilation), 0 if the run did not record it

    @property
    def training_seconds(self) -> list[float]:
        return [s - self.first_step_s for s in self.seconds]


def load_run(arg: str) -> Run:
    """The run named by `dir` or `label=dir`."""
    return load_run_dir(*parse_run_arg(arg))


def load_run_dir(label: str, path: Path) -> Run:
    records = run_metrics(path)
    val = [r for r in records if r["kind"] == "val" and "tokens" in r and "elapsed_s" in r]
    if not val:
        raise SystemExit(f"{path}: no validation records with tokens and elapsed_s (a run before issue 13?)")
    first = [r["elapsed_s"] for r in records if r["kind"] == "train" and r["step"] == 1 and "elapsed_s" in r]
    return Run(label, [r["tokens"] for r in val], [r["elapsed_s"] for r in val],
               [r["val_bpb"] for r in val], baselines_of(records), first[-1] if first else 0.0)


def plot(runs: list[Run], out: Path) -> None:
    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for run in runs:
        by_tokens.plot([t / 1e6 for t in run.tokens], run.bpb, marker="o", ms=3, label=run.label)
        by_time.plot([s / 60 for s in run.training_seconds], run.bpb, marker="o", ms=3, label=run.label)
    figures = {run.label: tuple(run.baselines.get(k) for k, _, _ in BASELINE_LINES)
               for run in runs if run.baselines is not None}
    several = len(set(figures.values())) > 1  # runs on other data: name the run each line belongs to
    # The axis spans the curves and the compressor lines; the unigram entropy (far above every trained
    # model) would squeeze the curves into the bottom fifth, so a line above the axis is only named.
    top = max(bpb for run in runs for bpb in run.bpb) * 1.05
    bottom = min(min(bpb for run in runs for bpb in run.bpb),
                 *(value for values in figures.values() for value in values if value is not None)) * 0.95
    drawn = set()
    for label, values in figures.items():
        if values in drawn:
            continue
        drawn.add(values)
        for (_, text, style), value in zip(BASELINE_LINES, values, strict=True):
            if value is None:
                continue
            name = f"{text} {value:.3f}" + (f" ({label})" if several else "")
            if value > top:
                by_time.plot([], [], color="gray", ls=style, lw=1, label=f"{name}, above the axis")
                continue
            by_tokens.axhline(value, color="gray", ls=style, lw=1)
            by_time.axhline(value, color="gray", ls=style, lw=1, label=name)
    by_tokens.set(xlabel="tokens trained (millions)", ylabel="validation bits per byte", title="per token")
    by_time.set(xlabel="wall time after the first step (minutes; evaluation included)", title="per minute")
    for ax in (by_tokens, by_time):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom, max(top, bottom * 1.1))
    by_tokens.legend()
    by_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def table(runs: list[Run]) -> str:
    head = ("| run | last val bpb | at tokens | at s | best val bpb | at tokens | at s | unigram | xz | "
            "xz given train |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        best = min(range(len(run.bpb)), key=run.bpb.__getitem__)
        b = run.baselines or {}
        figures = [f"{b[k]:.4f}" if k in b else "-" for k in ("unigram_bpb", "xz_bpb", "xz_given_train_bpb")]
        rows.append(f"| {run.label} | {run.bpb[-1]:.4f} | {run.tokens[-1]:,} | {run.seconds[-1]:.0f} | "
                    f"{run.bpb[best]:.4f} | {run.tokens[best]:,} | {run.seconds[best]:.0f} | {' | '.join(figures)} |")
    return "\n".join(rows)


def at_budget(run: Run, spent: list[float], budget: float) -> tuple[float, float] | None:
    """(bpb, spent) of the run's last evaluation within `budget`, or None if it has none."""
    within = [i for i, value in enumerate(spent) if value <= budget]
    return (run.bpb[within[-1]], spent[within[-1]]) if within else None


def equal_budgets(runs: list[Run]) -> str:
    tokens = min(run.tokens[-1] for run in runs)
    seconds = min(run.training_seconds[-1] for run in runs)
    rows = [f"| run | val bpb within {tokens:,} tokens | at tokens | val bpb within {seconds:.0f} s of training "
            "| at s |", "|---|---|---|---|---|"]
    for run in runs:
        by_tokens = at_budget(run, [float(t) for t in run.tokens], tokens)
        by_time = at_budget(run, run.training_seconds, seconds)
        cells = [f"{v[0]:.4f} | {v[1]:,.0f}" if v else "- | -" for v in (by_tokens, by_time)]
        rows.append(f"| {run.label} | {' | '.join(cells)} |")
    return "\n".join(rows)


def report(runs: list[Run], out: Path) -> str:
    """Plot `runs` into `out`; return the per-run table and, for several runs, the equal-budget one."""
    plot(runs, out)
    parts = [table(runs)] + ([equal_budgets(runs)] if len(runs) > 1 else []) + [f"plot: {out}"]
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories, optionally label=dir")
    parser.add_argument("--out", type=Path, default=Path("quality.png"), help="PNG to write")
    args = parser.parse_args()
    if not args.out.parent.is_dir():
        parser.error(f"--out {args.out}: directory {args.out.parent} does not exist")
    print(report([load_run(arg) for arg in args.runs], args.out))


if __name__ == "__main__":
    main()
