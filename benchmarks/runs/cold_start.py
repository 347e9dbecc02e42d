"""Cold first steps of `megacpp train`, several runs of each variant, alternating (issue 35's compile-time
target): each run a fresh process with a fresh compile cache, all reading one data directory prepared
once, so the runs differ only in what is compiled and how.

    python benchmarks/runs/cold_start.py --out /tmp/cold --rounds 3 \\
        "off=--compile.model_helper off" "on=--compile.model_helper on" -- --preset small --train.steps 30

A variant is `NAME=ARGS` (its own `megacpp train` arguments, split as a shell would; `NAME=` for none).
`--tree NAME=DIR` runs that variant from another source tree (run in DIR, DIR first on PYTHONPATH), e.g.
an older commit's export, to compare code. The arguments after `--` go to every run and to the one
`megacpp data prepare`. Rounds alternate the variants (a, b, a, b, ...), so a machine that slows down
during the call weighs on every variant alike.

Per run, from its metrics.jsonl and log: the first step and its phases, the process's start to its first
step (CUDA runs, which start under the auto-fit supervisor, print it), and the median tokens/s over
`--window` steps. From its Triton cache: how many variants of megacpp's own kernels were compiled, by
kernel. A kernel compiled in two variants where one was expected is a prewarm that missed: its helper
compiled a launch the run did not make (`megacpp/ops/kernel_prewarm.py`). Prints a row per run and the
medians per variant last, and writes both, with each run's kernel variants, to --out/summary.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from run_dirs import run_logged, step_window

from megacpp.train.metrics import read_metrics

PHASES = ("forward", "backward", "optimizer step")
START_TO_FIRST = re.compile(r"first step done ([\d.]+) s after the process started")


@dataclass(frozen=True)
class Variant:
    name: str
    args: tuple[str, ...]
    tree: Path | None = None


@dataclass(frozen=True)
class ColdRun:
    variant: str
    round: int
    exit: str
    first_step_s: float | None = None
    phases_s: dict[str, float] | None = None
    start_to_first_s: float | None = None
    tok_per_s: float | None = None
    kernel_variants: dict[str, int] | None = None  # megacpp's own Triton kernels in the run's cache, by name


def parse_variant(text: str) -> Variant:
    name, sep, args = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"variant {text!r}: expected NAME=ARGS, e.g. \"off=--compile.model_helper off\"")
    return Variant(name, tuple(shlex.split(args)))


def with_trees(variants: list[Variant], trees: list[str]) -> list[Variant]:
    """The variants with the `--tree NAME=DIR` settings applied; SystemExit for an unknown name or directory."""
    by_name = {v.name: v for v in variants}
    for text in trees:
        name, sep, directory = text.partition("=")
        if not sep or name not in by_name:
            raise SystemExit(f"--tree {text!r}: expected NAME=DIR with NAME one of {', '.join(by_name)}")
        if not (Path(directory) / "megacpp").is_dir():
            raise SystemExit(f"--tree {text!r}: {directory} holds no megacpp package")
        by_name[name] = Variant(name, by_name[name].args, Path(directory).resolve())
    return [by_name[v.name] for v in variants]


def own_kernel_variants(cache: Path) -> dict[str, int]:
    """The compiled variants of megacpp's own Triton kernels under a compile cache, by kernel name. Triton
    keeps one directory per compiled variant, with `<kernel>.json` beside the binary; Inductor's kernels
    are named `triton_*`, megacpp's by their Python names, which start with an underscore."""
    names = Counter()
    for meta in cache.rglob("*.json"):
        if meta.name.startswith("__grp__") or not meta.stem.startswith("_"):
            continue
        try:
            name = json.loads(meta.read_text()).get("name")
        except (OSError, ValueError):
            continue
        if name == meta.stem:
            names[name] += 1
    return dict(sorted(names.items()))


def read_run(variant: str, round_: int, exit_code: str, run_dir: Path, log: Path, window: tuple[int, int],
             cache: Path | None = None) -> ColdRun:
    """A run's figures from its metrics.jsonl (the compile record's first-step phases, the train records'
    tokens/s), its log (the start-to-first-step line) and its compile cache (megacpp's kernel variants);
    None where the run did not get that far."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    compile_records = [r for r in records if r["kind"] == "compile" and "first_step_phases_s" in r]
    phases = compile_records[0]["first_step_phases_s"] if compile_records else None
    rates = [r["tok_per_s"] for r in records if r["kind"] == "train" and window[0] <= r["step"] <= window[1]]
    found = START_TO_FIRST.search(log.read_text(errors="replace")) if log.is_file() else None
    variants = own_kernel_variants(cache) if cache is not None and cache.is_dir() else None
    return ColdRun(variant, round_, exit_code, sum(phases.values()) if phases else None, phases,
                   float(found.group(1)) if found else None, statistics.median(rates) if rates else None,
                   variants or None)


def tree_env(tree: Path | None, cache: Path) -> dict[str, str]:
    """The environment of a run: its own compile cache, and its tree first on the import path."""
    env = {**os.environ, "MEGACPP_CACHE_DIR": str(cache)}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def cold_run(v: Variant, round_: int, args: argparse.Namespace, extra: list[str], data: Path) -> ColdRun:
    label = f"{v.name}.{round_}"
    run_dir, cache, log = args.out / "runs" / label, args.out / "caches" / label, args.out / f"{label}.log"
    cache.mkdir(parents=True)  # fresh: main() refuses an --out that already holds runs
    cmd = [sys.executable, "-m", "megacpp.cli", "train", "--no-progress", *extra, *v.args,
           "--data.cache_dir", str(data), "--train.out_dir", str(run_dir)]
    code = run_logged(cmd, log, timeout_s=args.timeout_s, cwd=v.tree, env=tree_env(v.tree, cache))
    return read_run(v.name, round_, code, run_dir, log, args.window, cache)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def run_row(run: ColdRun) -> str:
    phases = [_seconds(run.phases_s.get(p)) if run.phases_s else "-" for p in PHASES]
    rate = "-" if run.tok_per_s is None else f"{run.tok_per_s:,.0f}"
    return (f"| {run.variant} | {run.round} | {run.exit} | {_seconds(run.first_step_s)} | {' | '.join(phases)} | "
            f"{_seconds(run.start_to_first_s)} | {rate} |")


def kernels_line(run: ColdRun) -> str:
    """`variant.round`: megacpp's kernels in its cache, the ones with more than one variant named."""
    label = f"{run.variant}.{run.round}"
    if not run.kernel_variants:
        return f"- {label}: no megacpp kernel in its cache"
    several = [f"{name} x{count}" for name, count in run.kernel_variants.items() if count > 1]
    return (f"- {label}: megacpp kernels {len(run.kernel_variants)}, compiled variants "
            f"{sum(run.kernel_variants.values())}; more than one variant: {', '.join(several) or 'none'}")


def median_row(name: str, runs: list[ColdRun]) -> str:
    def med(values: list[float | None]) -> float | None:
        kept = [x for x in values if x is not None]
        return statistics.median(kept) if kept else None

    firsts = [r.first_step_s for r in runs if r.first_step_s is not None]
    spread = f"{min(firsts):.1f}-{max(firsts):.1f}" if firsts else "-"
    rate = med([r.tok_per_s for r in runs])
    return (f"| {name} | {len(firsts)} of {len(runs)} | {_seconds(med(firsts))} | {spread} | "
            f"{_seconds(med([r.start_to_first_s for r in runs]))} | {'-' if rate is None else f'{rate:,.0f}'} |")


def summary(variants: list[Variant], runs: list[ColdRun], window: tuple[int, int]) -> str:
    lines = ["| variant | round | exit | first step s | forward | backward | optimizer step | start to first step s "
             f"| tok/s (median of steps {window[0]}-{window[1]}) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    lines += [run_row(r) for r in runs]
    lines += ["", "| variant | runs with a first step | first step s (median) | spread | start to first step s "
              "(median) | tok/s (median) |", "|---|---|---:|---|---:|---:|"]
    lines += [median_row(v.name, [r for r in runs if r.variant == v.name]) for v in variants]
    lines += ["", "megacpp's own Triton kernels compiled in each run's cache:", *[kernels_line(r) for r in runs]]
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", help='NAME=ARGS, e.g. "off=--compile.model_helper off"')
    p.add_argument("--out", type=Path, required=True, help="a new directory for the runs, caches and summary")
    p.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating (default 2)")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="run variant NAME from the source tree DIR (repeatable)")
    p.add_argument("--window", default="16:30", help="steps whose tokens/s are summarised, FIRST:LAST (default 16:30)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="each run's limit (default 900)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be >= 1")
    if not args.timeout_s > 0:
        raise SystemExit(f"--timeout-s {args.timeout_s}: must be > 0 seconds")
    args.window = step_window(args.window, "--window")
    args.out = args.out.resolve()  # a variant with its own tree runs in that tree's directory
    variants = with_trees([parse_variant(v) for v in args.variants], args.tree)
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit("variant names repeat: each NAME must be unique")
    if (args.out / "runs").exists():
        raise SystemExit(f"--out {args.out}: holds runs of an earlier call; give a new directory")
    data = args.out / "data"
    prepare = [sys.executable, "-m", "megacpp.cli", "data", "prepare", *extra, "--data.cache_dir", str(data)]
    args.out.mkdir(parents=True, exist_ok=True)
    code = run_logged(prepare, args.out / "prepare.log", timeout_s=args.timeout_s, cwd=None, env=None)
    if code != "0":
        raise SystemExit(f"megacpp data prepare exited {code}: see {args.out / 'prepare.log'}")
    runs = []
    for round_ in range(1, args.rounds + 1):
        for v in variants:
            runs.append(cold_run(v, round_, args, extra, data))
            print(run_row(runs[-1]), flush=True)
    text = summary(variants, runs, args.window)
    print(text)
    (args.out / "summary.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
