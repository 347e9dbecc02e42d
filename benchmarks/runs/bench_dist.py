"""Multi-GPU benchmarks: `megacpp train` under torchrun, each variant a fresh job.

Variants, by name:
- ``small-N[-bB][-accK][-STRATEGY]``: `small` on N GPUs, batch B per GPU (default 16), K micro-batches
  accumulated (default 1), STRATEGY ``auto`` (default: what `megacpp train` picks), ``replicate``,
  ``fsdp`` or ``hsdpS`` (hsdp with shard groups of S ranks). E.g. ``small-1``, ``small-1-b8`` (the
  kernels' batch-size loss), ``small-2-b8`` (the same global batch as small-1), ``small-8``,
  ``small-1-acc2`` (the same global batch and token stream as small-2).
- ``nam52[-dD][-gN][-epP][-STRATEGY]``: `nam52` cut to depth D (its pattern and widths unchanged; default
  full depth) on N GPUs (default: all visible), with ``dist.expert_parallel = P`` (default 1).
- ``nanochat-N[-bB]``: the anchor, nanochat d12 on N GPUs at batch B per GPU (default 16) on random
  tokens (`nanochat_anchor.py`; nanochat fetched to .peers/nanochat).

    python benchmarks/runs/bench_dist.py --out /tmp/bench_dist --variants small-1,small-2,small-2-b8,small-1-b8
    python benchmarks/runs/bench_dist.py --out /tmp/bench_dist --variants nanochat-1,nanochat-4,small-1,small-4
    python benchmarks/runs/bench_dist.py --out /tmp/bench_dist --variants nam52-ep4,nam52-ep8 --steps 12

For each: tokens/s per GPU and MFU (median over the second half of the steps, less the profiled ones), step
time, first-step time (compile), peak memory of rank 0, and the profile lines of its run
(``--set train.profile_steps=3`` asks for them: compute, exposed collectives and idle per rank; ``--set``
applies to megacpp's runs only).
Then the scaling efficiencies it can form: per-GPU tokens/s of each several-GPU `small` or `nanochat`
variant over the 1-GPU one at the same per-GPU batch,
of small-2-b8 over small-1 (same global batch) and over small-1-b8 (the communication's share alone), and
the largest loss difference of small-1-acc2 and small-2 (the same token stream).

``--timeout-s`` bounds each job's wall clock (its whole process group is killed past it). A job that ends
early, killed or failing, after logging steps (typically while writing its final checkpoint) is still
reported from the steps it logged, its line saying how it ended; only a job with fewer than two logged
steps counts as failed. Each job's output streams to ``--out/NAME.log`` as it runs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

from run_dirs import run_logged  # benchmarks/runs (the script's directory is on sys.path)

SMALL = re.compile(r"small-(?P<gpus>\d+)(?:-b(?P<batch>\d+))?(?:-acc(?P<accum>\d+))?(?:-(?P<strategy>[a-z]+\d*))?")
NANOCHAT = re.compile(r"nanochat-(?P<gpus>\d+)(?:-b(?P<batch>\d+))?")
NAM52 = re.compile(r"nam52(?:-d(?P<depth>\d+))?(?:-g(?P<gpus>\d+))?(?:-ep(?P<ep>\d+))?(?:-(?P<strategy>[a-z]+\d*))?")
STRATEGY = re.compile(r"(?P<name>auto|replicate|fsdp|hsdp(?=\d))(?P<shards>(?<=hsdp)\d+)?")


def strategy_args(text: str | None, variant: str) -> list[str]:
    """The dist arguments of a variant's strategy suffix (none: what `auto` picks)."""
    found = STRATEGY.fullmatch(text or "auto")
    if found is None:
        raise SystemExit(f"variant {variant!r}: strategy {text!r} is not auto, replicate, fsdp or hsdpS")
    shards = [f"--dist.shard_size={found['shards']}"] if found["shards"] else []
    return [f"--dist.strategy={found['name']}", *shards]


def plan(name: str, gpus: int) -> tuple[int, list[str], str]:
    """(processes, extra arguments, preset) of a variant; ``gpus``: the GPUs visible."""
    if found := SMALL.fullmatch(name):
        batch, accum = int(found["batch"] or 16), int(found["accum"] or 1)
        return int(found["gpus"]), [f"--train.batch_size={batch}", f"--train.grad_accum={accum}",
                                    *strategy_args(found["strategy"], name)], "small"
    if found := NAM52.fullmatch(name):
        extra = [f"--model.depth={found['depth']}"] if found["depth"] else []
        if found["ep"]:
            extra.append(f"--dist.expert_parallel={found['ep']}")
        if found["strategy"]:
            extra += strategy_args(found["strategy"], name)
        return int(found["gpus"] or gpus), extra, "nam52"
    if found := NANOCHAT.fullmatch(name):
        return int(found["gpus"]), [f"--batch={found['batch'] or 16}"], "nanochat"
    raise SystemExit(f"unknown variant {name!r} (expected small-N[-bB][-accK][-STRATEGY], "
                     "nam52[-dD][-gN][-epP][-STRATEGY] or nanochat-N[-bB])")


def run_variant(name: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    nproc, extra, preset = plan(name, args.gpus)
    if preset == "nanochat":
        return run_nanochat(name, nproc, extra, args, env)
    out = Path(args.out) / name
    code, output, wall = _torchrun(name, nproc, [
        "-m", "megacpp.cli", "train", "--preset", preset, "--no-progress", f"--train.steps={args.steps}",
        f"--train.out_dir={out}", f"--train.eval_every={args.steps}", f"--train.ckpt_every={args.steps}",
        "--train.sample_tokens=16", "--train.tensorboard=false", "--train.eval_batches=4",
        *extra, *(f"--{kv}" for kv in args.set)], args, env)
    result = run_figures(out, nproc)
    if result is None:
        _print_failure(name, code, output, Path(args.out) / f"{name}.log")
        return {"name": name, "failed": True}
    return _reported({**result, "name": name, "wall": wall, "ended": _ending(code, result["steps"]),
                      "profile": [line for line in output.splitlines() if "profile, steps" in line]})


def run_figures(run_dir: Path, nproc: int) -> dict | None:
    """A run's figures from the steps its metrics.jsonl holds (the median over their second half, the
    first step never among them: it is compile, not speed, and no step `train.profile_steps` profiled
    unless every one of that half was), or None when it logged fewer than two steps."""
    from megacpp.train.metrics import read_metrics

    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    train = [r for r in records if r["kind"] == "train"]
    if len(train) < 2:
        return None
    half = train[max(1, len(train) // 2):]
    # The profiler slows the host while it records: `small`'s profiled steps took 123 ms against 101 (A8).
    profiled = _profiled_steps(records)
    late = [r for r in half if r["step"] not in profiled] or half
    tokens_per_step = _tokens_per_step(run_dir, nproc)
    return {
        "failed": False, "gpus": nproc, "steps": train[-1]["step"], "losses": [r["loss"] for r in train],
        "timed_profiled": any(r["step"] in profiled for r in late),
        "first_step_s": tokens_per_step / train[0]["tok_per_s"],
        "step_ms": 1000 * statistics.median(tokens_per_step / r["tok_per_s"] for r in late),
        "tok_s_gpu": statistics.median(r["tok_per_s_per_gpu"] for r in late),
        "mfu": statistics.median(r.get("mfu", 0.0) for r in late),
        "peak_gib": max(r.get("peak_mem_gib", 0.0) for r in train),
        "val_bpb": next((r["val_bpb"] for r in records if r["kind"] == "val"), float("nan")),
        "first_steps": _first_step_lines(run_dir),
    }


def _profiled_steps(records: list[dict]) -> set[int]:
    """The steps a run's profile records (kind "profile", one entry per rank) say were profiled."""
    steps: set[int] = set()
    for record in records:
        if record["kind"] == "profile":
            for split in record.values():
                if isinstance(split, dict) and "first" in split and "last" in split:
                    steps.update(range(split["first"], split["last"] + 1))
    return steps


def _ending(code: str, steps: int) -> str:
    """How a job that logged `steps` steps ended when not by itself; "" for exit 0."""
    if code == "0":
        return ""
    return f"ended by --timeout-s after step {steps}" if code == "timeout" else f"exit {code} after step {steps}"


def run_nanochat(name: str, nproc: int, extra: list[str], args: argparse.Namespace, env: dict[str, str]) -> dict:
    """The anchor's job: `nanochat_anchor.py` under torchrun, nanochat's copy on PYTHONPATH."""
    out = Path(args.out) / f"{name}.json"
    peer = Path(__file__).resolve().parents[2] / ".peers" / "nanochat"
    env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(peer), env.get("PYTHONPATH", "")])))
    code, output, wall = _torchrun(name, nproc, [str(Path(__file__).with_name("nanochat_anchor.py")),
                                                 f"--steps={args.steps}", f"--out={out}", *extra], args, env)
    if code != "0" or not out.is_file():  # the anchor writes its figures only at its end
        _print_failure(name, code, output, Path(args.out) / f"{name}.log")
        return {"name": name, "failed": True}
    r = json.loads(out.read_text())
    late = r["step_s"][len(r["step_s"]) // 2:]
    return _reported({"name": name, "failed": False, "gpus": nproc, "wall": wall, "losses": r["losses"],
                      "first_step_s": r["step_s"][0], "step_ms": 1000 * statistics.median(late),
                      "tok_s_gpu": r["batch"] * r["seq"] / statistics.median(late), "mfu": r["mfu"],
                      "peak_gib": r["peak_gib"], "profile": [], "ended": ""}, " (nanochat's convention)")


def _torchrun(name: str, nproc: int, target: list[str], args: argparse.Namespace,
              env: dict[str, str]) -> tuple[str, str, float]:
    """A fresh ``torchrun --standalone`` job of `target` on `nproc` GPUs, its output streamed to
    --out/NAME.log: (exit code as text, or "timeout"; the output; wall seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target]
    log = Path(args.out) / f"{name}.log"
    t0 = time.perf_counter()
    code = run_logged(cmd, log, args.timeout_s or None, env=env)
    return code, log.read_text(errors="replace"), time.perf_counter() - t0


def _print_failure(name: str, code: str, output: str, log: Path) -> None:
    ended = "no end within --timeout-s" if code == "timeout" else f"exit {code}"
    print(f"{name}: FAILED ({ended}, fewer than two steps logged); tail of {log}:\n{output[-4000:]}", flush=True)


def _reported(result: dict, mfu_convention: str = "") -> dict:
    """`result`, once its line is printed."""
    print(f"{result['name']}: {result['gpus']} GPU(s), first step {result['first_step_s']:.1f} s, step "
          f"{result['step_ms']:.0f} ms, {result['tok_s_gpu']:,.0f} tok/s/GPU, MFU {100 * result['mfu']:.1f}%"
          f"{mfu_convention}, peak {result['peak_gib']:.1f} GiB, final loss {result['losses'][-1]:.4f}, "
          f"wall {result['wall']:.0f} s" + (f" ({result['ended']})" if result["ended"] else "")
          + (" (timed on profiled steps only: the profiler slows them; run more steps)"
             if result.get("timed_profiled") else ""), flush=True)
    return result


def _first_step_lines(run_dir: Path) -> list[str]:
    """Each rank's split of its first step (from ``logs/rank<R>.log``; the run log has rank 0's only): a
    rank that waits in a collective for a slower rank's compile shows it there."""
    lines = []
    for log in sorted((run_dir / "logs").glob("rank*.log"), key=lambda f: int(f.stem[4:])):
        messages = [line.split(" ", 2)[-1] for line in log.read_text().splitlines()]  # past the time stamp
        found = [message for message in messages if message.startswith("first step ")]
        lines += [f"{log.stem}: {found[0]}"] if found else []
    return lines


def _tokens_per_step(run_dir: Path, nproc: int) -> int:
    """Global tokens per optimizer step, from the run's own config."""
    import tomllib

    cfg = tomllib.loads((run_dir / "config.toml").read_text())
    return nproc * cfg["train"]["batch_size"] * cfg["train"]["grad_accum"] * cfg["data"]["seq_len"]


def scaling_pairs(names: list[str]) -> list[tuple[str, str, str]]:
    """(several-GPU variant, 1-GPU variant, what is compared) for the `small` and `nanochat` variants among
    ``names``: each against the 1-GPU run of the same per-GPU batch and accumulation, and small-2-b8 against
    small-1 (the same global batch)."""
    pairs = []
    for name in names:
        if (found := NANOCHAT.fullmatch(name)) and found["gpus"] != "1":
            one = "nanochat-1" + (f"-b{found['batch']}" if found["batch"] else "")
            if one in names:
                pairs.append((name, one, "same per-GPU batch, nanochat's own"))
        found = SMALL.fullmatch(name)
        if found is None or found["gpus"] == "1":
            continue
        one = "small-1" + "".join(f"-{k}{found[v]}" for k, v in (("b", "batch"), ("acc", "accum")) if found[v])
        if one in names:
            pairs.append((name, one, f"same per-GPU batch, {found['strategy'] or 'auto'}"))
    if "small-2-b8" in names and "small-1" in names:
        pairs.append(("small-2-b8", "small-1", "same global batch"))
    return pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/bench_dist")
    p.add_argument("--variants", default="small-1,small-2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--gpus", type=int, default=int(os.environ.get("GPUS", "0")) or None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every variant")
    p.add_argument("--timeout-s", type=float, default=0.0,
                   help="wall-clock limit of each job in seconds (0: none); see the description")
    args = p.parse_args()
    if args.timeout_s < 0:
        p.error(f"--timeout-s {args.timeout_s:g}: expected seconds >= 0 (0: no limit)")
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    names = args.variants.split(",")
    for name in names:  # every name checked before the first job starts
        plan(name, args.gpus)
    results = {name: run_variant(name, args, env) for name in names}

    print(f"\n{'variant':<14}{'GPUs':>5}{'first s':>9}{'step ms':>9}{'tok/s/GPU':>11}{'MFU':>7}{'peak GiB':>10}"
          f"{'loss':>8}")
    for r in results.values():
        if r["failed"]:
            print(f"{r['name']:<14}{'failed':>14}")
            continue
        print(f"{r['name']:<14}{r['gpus']:>5}{r['first_step_s']:>9.1f}{r['step_ms']:>9.0f}{r['tok_s_gpu']:>11,.0f}"
              f"{100 * r['mfu']:>6.1f}%{r['peak_gib']:>10.1f}{r['losses'][-1]:>8.4f}")
    for r in results.values():
        for line in r.get("profile", []):
            print(f"{r['name']}: {line.split('profile, ', 1)[1]}")
        for line in r.get("first_steps", []):
            print(f"{r['name']}: {line}")
    ok = {name: r for name, r in results.items() if not r["failed"]}
    for two, one, what in scaling_pairs(list(ok)):
        print(f"{two} vs {one} ({what}): {100 * ok[two]['tok_s_gpu'] / ok[one]['tok_s_gpu']:.1f}% per GPU")
    if "small-1-acc2" in ok and "small-2" in ok:
        one, two = ok["small-1-acc2"]["losses"], ok["small-2"]["losses"]
        diffs = [abs(a - b) for a, b in zip(one, two, strict=True)]
        print(f"small-1-acc2 vs small-2 (one token stream): max |loss difference| {max(diffs):.3e} over "
              f"{len(diffs)} steps, final {one[-1]:.4f} vs {two[-1]:.4f}")


if __name__ == "__main__":
    main()
