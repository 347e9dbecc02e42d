"""A run resumed on other numbers of GPUs and back: does it continue the uninterrupted run?

    python benchmarks/runs/resume_across.py --out /tmp/ra --gpus 8,2,8 --preset nam52 --steps 12 -- \\
        --train.recompute all
    python benchmarks/runs/resume_across.py --out /tmp/ra --gpus 8,2,8 --set-at 8:dist.expert_parallel=4 -- \
        --train.recompute all                     # EP 4 x 2 replicas on 8 GPUs, replicate/fsdp (auto) on 2
    python benchmarks/runs/resume_across.py --out /tmp/ra --gpus 2,1,2 --cpu -- <megacpp train arguments>

The first entry of --gpus trains the uninterrupted run (`straight`) for --steps steps, with a checkpoint
every --every steps (default: --steps over the number of stages). Stage i then copies stage i-1's run
directory (stage 0: the straight run's), keeps its checkpoints and metrics up to step i x every, and
resumes from there with `--resume` on gpus[i] GPUs to the last step. Every stage keeps the rows of an
optimizer step (GPUs x batch x grad_accum, README "Resuming on another number of GPUs"): the per-GPU
micro-batch stays --batch and grad_accum makes up the rest, so every stage reads the straight run's rows.

Printed per stage: the loss at its first step against the previous stage's at that step (the same
weights, from that stage's checkpoint, and the same rows: equal but for the order of the ranks' sums),
and the largest loss difference from the straight run over its steps up to the next stage's start (from
stage 2 on the weights also carry the earlier stages' rounding); then every run's loss at each step it trained
and its last validation bits/byte. Exit status 1 when a launch fails or a
stage's first-step loss differs by more than --first-step-rtol (another token stream, or weights that did
not load). `--set-at GPUS:KEY=VALUE` (repeatable) gives every launch on that many GPUs one more setting, e.g.
a layout only that world size can take (expert parallelism 4 needs a multiple of 4 ranks); the arguments
after `--` go to every launch. `--cpu`: gloo ranks on the CPU
(the test's mode); otherwise every launch is a `torchrun` on this host's GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from run_dirs import run_logged, run_metrics  # benchmarks/runs (the script's directory is on sys.path)

from megacpp.presets import PRESETS, preset

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="a directory for the runs (emptied first)")
    p.add_argument("--gpus", default="8,2,8", help="world size of each stage, the first the straight run's")
    p.add_argument("--preset", default="nam52", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=0, help="steps per stage (0: --steps over the stages)")
    p.add_argument("--batch", type=int, default=0, help="micro-batch per GPU (0: the preset's batch_size)")
    p.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU instead of GPUs")
    p.add_argument("--timeout-s", type=float, default=1800, help="wall-clock limit of each launch")
    p.add_argument("--first-step-rtol", type=float, default=1e-3)
    p.add_argument("--set-at", action="append", default=[], metavar="GPUS:KEY=VALUE",
                   help="a setting for every launch on GPUS GPUs (repeatable)")
    args = p.parse_args(own)
    args.set_at = _settings_by_world_size(p, args.set_at)
    try:
        args.gpus = [int(g) for g in args.gpus.split(",")]
    except ValueError:
        p.error(f"--gpus {args.gpus!r}: expected world sizes separated by commas, e.g. 8,2,8")
    if len(args.gpus) < 2 or min(args.gpus) < 1:
        p.error(f"--gpus {','.join(map(str, args.gpus))}: give at least two world sizes, each >= 1")
    stages = len(args.gpus)
    args.every = args.every or args.steps // stages
    if args.every < 1 or args.every * (stages - 1) >= args.steps:
        p.error(f"--steps {args.steps} with --every {args.every}: every stage needs at least one step "
                f"(stage {stages - 1} starts at step {args.every * (stages - 1)})")
    unused = sorted(set(args.set_at) - set(args.gpus))
    if unused:
        p.error(f"--set-at {unused}: no stage runs on that many GPUs (--gpus {','.join(map(str, args.gpus))})")
    if not args.batch:
        args.batch = preset(args.preset).train.batch_size
    rows = args.batch * args.gpus[0]
    uneven = [g for g in args.gpus if args.gpus[0] % g]
    if uneven:
        p.error(f"--gpus {uneven}: {rows} rows per step (the first stage's {args.gpus[0]} x {args.batch}) "
                f"are not a whole number of micro-batches of {args.batch} per GPU")
    return args, extra


def _settings_by_world_size(p: argparse.ArgumentParser, given: list[str]) -> dict[int, list[str]]:
    """`--set-at GPUS:KEY=VALUE` entries as {GPUS: ["--KEY=VALUE", ...]}; a malformed one is a usage error."""
    settings: dict[int, list[str]] = {}
    for entry in given:
        gpus, _, setting = entry.partition(":")
        key, equals, value = setting.partition("=")
        if not (gpus.isdigit() and int(gpus) >= 1 and key and equals and value):
            p.error(f"--set-at {entry!r}: expected GPUS:KEY=VALUE, e.g. 8:dist.expert_parallel=4")
        settings.setdefault(int(gpus), []).append(f"--{key}={value}")
    return settings


def accumulation(args: argparse.Namespace, gpus: int) -> int:
    """Micro-batches per step on `gpus` GPUs that keep the first stage's rows per step."""
    return args.gpus[0] // gpus


def train_command(args: argparse.Namespace, gpus: int, out_dir: Path, extra: list[str], resume: bool) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                "-m", "megacpp.cli"]
    return [*launcher, "train", "--preset", args.preset, "--no-progress", *extra, *args.set_at.get(gpus, []),
            f"--train.steps={args.steps}", f"--train.ckpt_every={args.every}",
            f"--train.keep_last={args.steps // args.every + 1}", f"--train.batch_size={args.batch}",
            f"--train.grad_accum={accumulation(args, gpus)}", f"--train.out_dir={out_dir}",
            *(["--resume"] if resume else [])]


def launch(cmd: list[str], log: Path, args: argparse.Namespace) -> None:
    """Run one training job under the wall-clock limit, its output in `log`; SystemExit when it fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    if args.cpu:
        env.update({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    code = run_logged(cmd, log, args.timeout_s, cwd=ROOT, env=env)
    if code != "0":
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise SystemExit(f"{log.name}: {'no end within the time limit' if code == 'timeout' else 'exit ' + code}; "
                         f"the last lines of {log}:\n{tail}")


def losses(run_dir: Path) -> dict[int, float]:
    """Training loss per step; a step logged again after a resume keeps its latest record."""
    return {r["step"]: r["loss"] for r in run_metrics(run_dir) if r["kind"] == "train"}


def last_validation(run_dir: Path) -> float | None:
    """The run's last validation bits per byte, None where it logged none."""
    found = [r["val_bpb"] for r in run_metrics(run_dir) if r["kind"] == "val" and "val_bpb" in r]
    return found[-1] if found else None


def loss_table(runs: dict[str, dict[int, float]], starts: dict[str, int]) -> list[str]:
    """Markdown rows of every run's loss at each step it trained (from `starts[name] + 1`), the straight run's
    first: where a drift from it began and how it grew, which the stages' largest differences do not show."""
    names = list(runs)
    steps = sorted({step for losses_ in runs.values() for step in losses_})
    lines = ["| step | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for step in steps:
        cells = [f"{runs[n][step]:.6f}" if step in runs[n] and step > starts[n] else "" for n in names]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def cut_to(run_dir: Path, step: int) -> None:
    """Leave the run as it was at `step`: later checkpoints and metrics records go."""
    for ckpt in (run_dir / "checkpoints").iterdir():
        if ckpt.name.startswith("step_") and int(ckpt.name.split("_")[1].split(".")[0]) > step:
            shutil.rmtree(ckpt)
    metrics = run_dir / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines() if json.loads(line).get("step", 0) <= step]
    metrics.write_text("".join(line + "\n" for line in kept))


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    straight = args.out / "straight"
    started = time.monotonic()
    launch(train_command(args, args.gpus[0], straight, extra, False), args.out / "straight.log", args)
    print(f"straight: {args.gpus[0]} GPU(s), {args.steps} steps in {time.monotonic() - started:.0f} s", flush=True)
    reference = losses(straight)
    previous, before, failed = straight, reference, False
    rows = []
    runs, starts, dirs = {"straight": reference}, {"straight": 0}, {"straight": straight}
    for stage, gpus in enumerate(args.gpus[1:], start=1):
        start = stage * args.every
        run_dir = args.out / f"stage{stage}"
        shutil.copytree(previous, run_dir)
        cut_to(run_dir, start)
        started = time.monotonic()
        launch(train_command(args, gpus, run_dir, extra, True), args.out / f"stage{stage}.log", args)
        seconds = time.monotonic() - started
        got = losses(run_dir)
        end = args.steps if stage == len(args.gpus) - 1 else start + args.every
        steps = range(start + 1, end + 1)
        missing = [s for s in steps if s not in got]
        if missing:
            raise SystemExit(f"stage {stage}: no loss logged for steps {missing} in {run_dir / 'metrics.jsonl'}")
        first = abs(got[start + 1] - before[start + 1])
        worst = max(abs(got[s] - reference[s]) for s in steps)
        same = first <= args.first_step_rtol * abs(before[start + 1])
        failed |= not same
        accum = accumulation(args, gpus)
        rows.append((stage, gpus, accum, start, end, before[start + 1], first, worst, same, seconds))
        print(f"stage {stage}: {gpus} GPU(s) x {args.batch} x accum {accum} from step {start}: first-step loss "
              f"{got[start + 1]:.6f} against the previous stage's {before[start + 1]:.6f} (|diff| {first:.2e}); "
              f"largest |diff| from the straight run to step {end} {worst:.2e}; {seconds:.0f} s", flush=True)
        previous, before = run_dir, got
        runs[f"stage {stage}"], starts[f"stage {stage}"], dirs[f"stage {stage}"] = got, start, run_dir
    print("\n| stage | GPUs x batch x accum | steps | first-step loss, previous stage | its \\|diff\\| |"
          " largest \\|diff\\| from straight | same rows |")
    print("|---|---|---|---:|---:|---:|---|")
    for stage, gpus, accum, start, end, ref, first, worst, same, _ in rows:
        print(f"| {stage} | {gpus} x {args.batch} x {accum} | {start + 1}-{end} | {ref:.6f} | {first:.2e} | "
              f"{worst:.2e} | {'yes' if same else 'NO'} |")
    print("\nLoss per step (each stage from its first step on):")
    print("\n".join(loss_table(runs, starts)))
    finals = {name: last_validation(run_dir) for name, run_dir in dirs.items()}
    print("last validation bits/byte: " + ", ".join(
        f"{name} {'none logged' if bpb is None else f'{bpb:.4f}'}" for name, bpb in finals.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
