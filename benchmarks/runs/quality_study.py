"""Train several variants under one budget, one after another, and compare them (issue 13's study).

    python benchmarks/runs/quality_study.py --out /tmp/qs --budget-s 180 \\
        small="--preset small" dense="--preset dense" \\
        "small T8192=--preset small --data.seq_len 8192 --train.batch_size 4"

Each variant is `label=arguments of megacpp train`; every run also gets the study's budget
(`--train.time_budget_s`, or `--steps` for equal tokens), `--train.eval_every`, no intermediate
checkpoints and its own `--train.out_dir` under --out. Runs are sequential on the same device, each a
fresh process under a timeout (a hang or a crash is reported and the study goes on). At the end:
`compare_quality.py`'s tables and plot (--out/quality.png) and `loss_spread.py`'s table, whose last
columns name the block kind with the largest gradient norm at each spike and the block where it starts.

A budget includes compilation, so variants compiled from caches of different warmth are not compared
fairly: on an H200, `small` with `--optim.lr_scale_by_kind M=0.5,R=0.5,E=0.5` took 108 s to its first
step against 32 s without (its per-kind optimizer groups are a graph the cache did not hold) and
trained 149 steps in 125 s against 442. `--prewarm` first runs each variant for 2 steps (its own
directory, not compared), so every budget is spent training.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import run_dirs
from compare_quality import load_run_dir, report
from loss_spread import spread, spread_table
from run_dirs import step_window

# Beyond the budget: data preparation, the final evaluation, checkpoint and sample.
SLACK_S = 300


# A prewarm run: two steps, one evaluation batch, a four-token sample; only its compilation matters.
PREWARM = ["--train.steps", "2", "--train.eval_every", "2", "--train.eval_batches", "1", "--train.sample_tokens", "4"]
PREWARM_TIMEOUT_S = 900  # a cold compile of `small` at 8192 tokens alone took over 200 s on an H200


def run_variant(label: str, args: list[str], out: Path, budget: list[str], eval_every: int, timeout_s: float | None
                ) -> bool:
    run_dir = out / label.replace(" ", "_")
    cmd = [sys.executable, "-m", "megacpp.cli", "train", *args, *budget, "--train.eval_every", str(eval_every),
           "--train.ckpt_every", "1000000", "--train.out_dir", str(run_dir), "--train.overwrite", "true",
           "--no-progress"]
    return run_logged(label, cmd, out / f"{run_dir.name}.log", timeout_s)


def prewarm_variant(label: str, args: list[str], out: Path) -> bool:
    run_dir = out / "prewarm" / label.replace(" ", "_")
    cmd = [sys.executable, "-m", "megacpp.cli", "train", *args, *PREWARM, "--train.ckpt_every", "1000000",
           "--train.out_dir", str(run_dir), "--train.overwrite", "true", "--no-progress"]
    return run_logged(f"{label} (prewarm)", cmd, out / "prewarm" / f"{run_dir.name}.log", PREWARM_TIMEOUT_S)


def run_logged(label: str, cmd: list[str], log: Path, timeout_s: float | None) -> bool:
    """Run one training command with its output in ``log``; print its exit and last line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    code = run_dirs.run_logged(cmd, log, timeout_s)
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    print(f"{label}: exit {code} in {time.perf_counter() - start:.0f} s; {tail[0][:160]}", flush=True)
    return code == "0"


def parse_variants(variants: list[str]) -> list[tuple[str, list[str]]]:
    """(label, train arguments) of each `label=arguments`, all checked before any run starts: a mistake
    in the last variant must not surface after the others have trained. Labels name run directories,
    so two that name the same one are refused too."""
    parsed, dirs = [], {}
    for variant in variants:
        label, sep, rest = variant.partition("=")
        if not sep or not label:
            raise SystemExit(f"variant {variant!r}: expected label=arguments")
        try:
            args = shlex.split(rest)
        except ValueError as exc:
            raise SystemExit(f"variant {variant!r}: {exc}") from None
        run_dir = label.replace(" ", "_")
        if run_dir in dirs:
            raise SystemExit(f"variants {dirs[run_dir]!r} and {label!r} would train into the same directory {run_dir}")
        dirs[run_dir] = label
        parsed.append((label, args))
    return parsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help='label="megacpp train arguments"')
    parser.add_argument("--out", type=Path, required=True, help="directory for the runs, logs and plot")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-s", type=float, help="wall-clock budget of each run (equal time)")
    budget.add_argument("--steps", type=int, help="steps of each run (equal tokens at equal batch)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--prewarm", action="store_true",
                        help="run each variant for 2 steps first, so no budget is spent compiling")
    parser.add_argument("--spread-steps", default="20:100000", help="first:last step of loss_spread's window")
    args = parser.parse_args()
    variants = parse_variants(args.variants)
    first, last = step_window(args.spread_steps, "--spread-steps")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.budget_s is not None:
        limit, timeout_s = ["--train.time_budget_s", str(args.budget_s)], args.budget_s + SLACK_S
    else:
        limit, timeout_s = ["--train.steps", str(args.steps)], None
    finished = []
    for label, train_args in variants:
        if args.prewarm:
            prewarm_variant(label, train_args, args.out)
        if run_variant(label, train_args, args.out, limit, args.eval_every, timeout_s):
            finished.append((label, args.out / label.replace(" ", "_")))
    if not finished:
        raise SystemExit("no variant finished")
    print(report([load_run_dir(label, path) for label, path in finished], args.out / "quality.png"))
    print(f"\nloss spread, steps {first}..{last}")
    print(spread_table([(label, spread(path, first, last)) for label, path in finished]))


if __name__ == "__main__":
    main()
