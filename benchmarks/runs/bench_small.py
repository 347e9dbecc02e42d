"""Whole-run benchmarks of a preset on one GPU, each variant a fresh `megacpp train` process:

- fast path, compiled blocks, cold compile cache, then again warm (first-step time = compile cost;
  the two runs' losses give the fast path's run-to-run spread);
- eager (compile.mode none);
- the seed's alternative: blocks compiled but every M mixer behind torch.compiler.disable (one graph
  break per M sublayer);
- bitwise mode (--train.deterministic) twice: losses must be identical.

    python benchmarks/runs/bench_small.py --preset small --steps 50 --out /tmp/bench_small

Prints a table last: first-step seconds, median step ms, tokens/s, final loss, and the loss checks.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DISABLE_M = (
    "import sys, torch; from megacpp.model.mamba3 import Mamba3; "
    "Mamba3.forward = torch.compiler.disable(Mamba3.forward); "
    "from megacpp.cli import main; sys.exit(main(sys.argv[1:]))"
)


def run_variant(name: str, args: argparse.Namespace, extra: list[str], env: dict[str, str],
                disable_m: bool = False) -> dict:
    out = Path(args.out) / name
    cmd = [sys.executable, "-c", DISABLE_M] if disable_m else [sys.executable, "-m", "megacpp.cli"]
    cmd += ["train", "--preset", args.preset, "--no-progress", f"--train.steps={args.steps}",
            f"--train.out_dir={out}", "--train.log_every=1", f"--train.eval_every={args.steps}",
            f"--train.ckpt_every={args.steps}", "--train.sample_tokens=16", "--train.tensorboard=false",
            # A variant's directory left by an earlier (or killed) call is started over, not refused.
            "--train.overwrite=true",
            *(f"--{kv}" for kv in args.set), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log = (Path(args.out) / f"{name}.log")
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(f"{name}: FAILED (exit {proc.returncode}); tail of {log}:\n{(proc.stdout + proc.stderr)[-3000:]}")
        return {"name": name, "failed": True, "wall": wall}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    tokens = args.batch_tokens
    step_s = [tokens / r["tok_per_s"] for r in train]
    result = {
        "name": name, "failed": False, "wall": wall, "losses": [r["loss"] for r in train],
        "first_step_s": step_s[0], "median_step_ms": 1000 * statistics.median(step_s[len(step_s) // 2:]),
        "mfu": statistics.median(r.get("mfu", 0.0) for r in train[len(train) // 2:]),
    }
    digest = hashlib.sha256(json.dumps(result["losses"]).encode()).hexdigest()[:16]
    print(f"{name}: first step {result['first_step_s']:.1f}s, median step {result['median_step_ms']:.1f} ms, "
          f"wall {wall:.0f}s, final loss {result['losses'][-1]:.4f}, losses sha256 {digest}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default="/tmp/bench_small")
    p.add_argument("--variants", default="cold,warm,bitwise1,bitwise2,eager,disable_m")
    p.add_argument("--batch-tokens", type=int, default=16 * 2048)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override passed to every variant, e.g. --set model.mamba.scan_matmuls=activation")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MEGACPP_CACHE_DIR=str(Path(args.out) / "cache"), PYTHONUNBUFFERED="1")
    plan = {
        "cold": ([], False), "warm": ([], False), "eager": (["--compile.mode=none"], False),
        "disable_m": ([], True), "bitwise1": (["--train.deterministic=true"], False),
        "bitwise2": (["--train.deterministic=true"], False),
    }
    results: dict[str, dict] = {}
    reported: set[str] = set()
    for name in args.variants.split(","):
        extra, disable_m = plan[name]
        results[name] = run_variant(name, args, extra, env, disable_m)
        # Print each comparison as soon as both runs exist: a call cut by its time limit keeps them.
        for line_name, line in comparisons(results, args.steps).items():
            if line_name not in reported:
                print(line, flush=True)
                reported.add(line_name)

    print(f"\n{args.preset}, {args.steps} steps, {args.batch_tokens} tokens/step")
    print(f"{'variant':<12}{'first step s':>14}{'median ms':>12}{'tok/s':>12}{'MFU':>8}{'final loss':>12}")
    for r in results.values():
        if r["failed"]:
            print(f"{r['name']:<12}{'failed':>14}")
            continue
        tok_s = args.batch_tokens / r["median_step_ms"] * 1000
        print(f"{r['name']:<12}{r['first_step_s']:>14.1f}{r['median_step_ms']:>12.1f}{tok_s:>12,.0f}"
              f"{100 * r['mfu']:>7.1f}%{r['losses'][-1]:>12.4f}")
    print("\n".join(comparisons(results, args.steps).values()))


def comparisons(results: dict[str, dict], steps: int) -> dict[str, str]:
    """Run-to-run checks available so far: bitwise pair identical? fast pair's per-step spread."""
    ok = {k: v for k, v in results.items() if not v["failed"]}
    out = {}
    if "bitwise1" in ok and "bitwise2" in ok:
        same = ok["bitwise1"]["losses"] == ok["bitwise2"]["losses"]
        out["bitwise"] = f"bitwise mode, two runs: losses identical for all {steps} steps: {same}"
    if "cold" in ok and "warm" in ok:
        diffs = [abs(a - b) for a, b in zip(ok["cold"]["losses"], ok["warm"]["losses"], strict=True)]
        first = next((i + 1 for i, d in enumerate(diffs) if d > 0), None)
        out["fast"] = (f"fast path, two runs: max |loss difference| over {steps} steps = {max(diffs):.3e}, "
                       f"median {statistics.median(diffs):.3e}, first differing step {first}")
    return out


if __name__ == "__main__":
    main()
