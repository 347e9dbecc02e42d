"""Models at several context lengths on the same data and the same tokens, one run per GPU at a time
(issue 36's study): tokens/s, memory, bits/byte per token and per training minute, the position curve
and the C++ syntax pass rate of each.

    python benchmarks/runs/context_study.py --out /tmp/cs --gpus 0,1 --steps 200 \\
        small:2048 dense:2048 small:16384 dense:16384 -- --data.corpus system --data.documents repository

Each variant is `preset:seq_len`. Every run reads `--tokens-per-step` tokens a step (batch = tokens /
seq_len rows) for `--steps` steps, so all variants see the same tokens; the time comparison is
compare_quality.py's (training time after the first step, each run cut where the shortest one ended).
Lengths past 8,192 get `model.attention.max_seq_len` and the documented RoPE theta for the length
(`rope_theta_for_length`). After training, `megacpp eval --by-position` (and `--cpp-syntax N`) runs on
the same GPU, and with `--window W` the curve again with each document read in windows of W tokens
(`--context-window`): where the two differ, the model uses context past W. Variants go to the GPUs in
the order given (the next free GPU takes the next variant); each command runs under a timeout, a failure
is reported and the study goes on. The arguments after `--` go to every `megacpp train`. Prints the
tables at the end and writes them to --out/summary.md; every run's output is in --out.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import run_dirs
from compare_quality import load_run_dir, report
from run_dirs import run_metrics

from megacpp.model.rope_theta import rope_theta_for_length

PRESET_MAX_SEQ_LEN = 8192  # the presets' attention.max_seq_len and RoPE tables
WINDOW_CURVE = "position_curve_window.json"


@dataclass(frozen=True)
class Variant:
    preset: str
    seq_len: int

    @property
    def label(self) -> str:
        return f"{self.preset}_{self.seq_len}"


def parse_variant(text: str) -> Variant:
    preset, sep, length = text.partition(":")
    if not sep or not length.isdigit():
        raise SystemExit(f"variant {text!r}: expected PRESET:SEQ_LEN, e.g. small:16384")
    return Variant(preset, int(length))


def train_args(v: Variant, args: argparse.Namespace, extra: list[str]) -> list[str]:
    if args.tokens_per_step % v.seq_len:
        raise SystemExit(f"--tokens-per-step {args.tokens_per_step} is not a multiple of {v.label}'s length")
    cmd = ["--preset", v.preset, "--data.seq_len", str(v.seq_len),
           "--train.batch_size", str(args.tokens_per_step // v.seq_len), "--train.steps", str(args.steps),
           "--train.eval_every", str(args.eval_every), "--train.ckpt_every", "1000000",
           "--train.out_dir", str(args.out / v.label), "--train.overwrite", "true"]
    if v.seq_len > PRESET_MAX_SEQ_LEN:
        try:
            theta = rope_theta_for_length(v.seq_len)
        except ValueError as e:
            raise SystemExit(f"{v.label}: {e}") from None
        cmd += ["--model.attention.max_seq_len", str(v.seq_len), "--model.attention.rope_theta", str(theta)]
    return cmd + extra


def run_logged(cmd: list[str], log: Path, gpu: str, timeout_s: float) -> str:
    """Run ``cmd`` on GPU ``gpu`` with its output in ``log``: its exit code, or "timeout"."""
    return run_dirs.run_logged(cmd, log, timeout_s, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})


def run_variant(v: Variant, gpu: str, args: argparse.Namespace, extra: list[str]) -> None:
    megacpp = [sys.executable, "-m", "megacpp.cli"]
    start = time.perf_counter()
    code = run_logged([*megacpp, "train", *train_args(v, args, extra), "--no-progress"],
                      args.out / f"{v.label}.train.log", gpu, args.timeout_s)
    print(f"{v.label} on GPU {gpu}: train exit {code} in {time.perf_counter() - start:.0f} s", flush=True)
    if code != "0":
        return
    start = time.perf_counter()
    evaluate = [*megacpp, "eval", "--checkpoint", str(args.out / v.label), "--by-position",
                "--out", str(args.out / v.label / "position_curve.json")]
    if args.cpp_syntax:
        evaluate += ["--cpp-syntax", str(args.cpp_syntax), "--cpp-context", str(args.cpp_context),
                     "--cpp-tokens", str(args.cpp_tokens)]
    code = run_logged(evaluate, args.out / f"{v.label}.eval.log", gpu, args.timeout_s)
    print(f"{v.label} on GPU {gpu}: eval exit {code} in {time.perf_counter() - start:.0f} s", flush=True)
    if args.window and args.window < v.seq_len:
        start = time.perf_counter()
        cut = [*megacpp, "eval", "--checkpoint", str(args.out / v.label), "--by-position",
               "--context-window", str(args.window), "--out", str(args.out / v.label / WINDOW_CURVE)]
        code = run_logged(cut, args.out / f"{v.label}.eval_window.log", gpu, args.timeout_s)
        print(f"{v.label} on GPU {gpu}: eval with the context cut to {args.window} exit {code} in "
              f"{time.perf_counter() - start:.0f} s", flush=True)


def evaluated(run: Path) -> bool:
    """Whether the run directory holds a validation record (a run that failed at its start holds none)."""
    return (run / "metrics.jsonl").is_file() and any(r["kind"] == "val" for r in run_metrics(run))


def curve_picks(path: Path) -> str:
    """A curve's buckets at 1, 1025 and 8193 tokens and its last, as "first-last: bits/byte, ..."."""
    if not path.is_file():
        return ""
    data = json.loads(path.read_text())["buckets"]
    picks = [b for b in data if b["first"] in (1, 1025, 8193) or b is data[-1]]
    return ", ".join(f"{b['first']}-{b['last']}: {b['bits_per_byte']:.3f}" for b in picks
                     if b["bits_per_byte"] is not None)


def summary_row(v: Variant, out: Path) -> str:
    """One table row: throughput and memory from the training records, the final and position figures."""
    run = out / v.label
    if not (run / "metrics.jsonl").is_file():
        return f"| {v.label} | no run |"
    if not evaluated(run):
        return (f"| {v.label} | no validation record: the training failed or stopped before its first evaluation "
                f"(its output: {out / f'{v.label}.train.log'}) |")
    records = run_metrics(run)
    train = [r for r in records if r["kind"] == "train"]
    half = train[len(train) // 2:]
    tok_s = statistics.median(r["tok_per_s"] for r in half) if half else 0.0
    mfu = statistics.median(r.get("mfu", 0.0) for r in half) if half else 0.0
    peak = max((r.get("peak_mem_gib", 0.0) for r in train), default=0.0)
    first = next((r["elapsed_s"] for r in train if r["step"] == 1 and "elapsed_s" in r), 0.0)
    vals = [r for r in records if r["kind"] == "val"]
    last_val = f"{vals[-1]['val_bpb']:.4f}" if vals else "-"
    buckets = curve_picks(run / "position_curve.json")
    if cut := curve_picks(run / WINDOW_CURVE):
        window = json.loads((run / WINDOW_CURVE).read_text())["context_window"]
        buckets += f"; context cut to {window}: {cut}"
    syntax = "-"
    log = out / f"{v.label}.eval.log"
    if log.is_file():
        lines = [line for line in log.read_text().splitlines() if line.startswith("C++ syntax pass rate")]
        syntax = lines[-1].split(";")[0].removeprefix("C++ syntax pass rate: ") if lines else "-"
    return (f"| {v.label} | {tok_s:,.0f} | {100 * mfu:.1f}% | {peak:.1f} | {first:.0f} | {last_val} | "
            f"{buckets} | {syntax} |")


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", help="PRESET:SEQ_LEN, e.g. small:16384")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gpus", default="0", help="comma-separated CUDA device indices, one run on each at a time")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tokens-per-step", type=int, default=65536)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--cpp-syntax", type=int, default=0, help="held-out functions completed per model (0: off)")
    p.add_argument("--cpp-context", type=int, default=512)
    p.add_argument("--cpp-tokens", type=int, default=96)
    p.add_argument("--window", type=int, default=0,
                   help="also the position curve with each document read in windows of this many tokens (0: off)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="each training or evaluation command's limit")
    args = p.parse_args(argv)
    if args.window < 0:
        raise SystemExit(f"--window {args.window}: must be >= 0 tokens (0: off)")
    variants = [parse_variant(v) for v in args.variants]
    for v in variants:  # every variant's arguments are checked before any run starts
        train_args(v, args, extra)
    args.out.mkdir(parents=True, exist_ok=True)

    todo: queue.Queue[Variant] = queue.Queue()
    for v in variants:
        todo.put(v)

    def worker(gpu: str) -> None:
        while True:
            try:
                v = todo.get_nowait()
            except queue.Empty:
                return
            run_variant(v, gpu, args, extra)

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in args.gpus.split(",")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    lines = ["| run | tokens/s | MFU | peak GiB | first step s | val bits/byte | by position (tokens: bits/byte) "
             "| C++ syntax |", "|---|---:|---:|---:|---:|---:|---|---|"]
    lines += [summary_row(v, args.out) for v in variants]
    by_length: dict[int, list] = {}
    for v in variants:
        if evaluated(args.out / v.label):
            by_length.setdefault(v.seq_len, []).append(load_run_dir(v.label, args.out / v.label))
    for length, runs in sorted(by_length.items()):
        lines.append(f"\n## {length} tokens of context\n{report(runs, args.out / f'quality_{length}.png')}")
    text = "\n".join(lines)
    print(text)
    # The whole result in one file: the table alone outlives the run directories' checkpoints.
    (args.out / "summary.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
