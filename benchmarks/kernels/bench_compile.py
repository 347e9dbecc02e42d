"""Compile benchmark: cold vs warm (cache) compile time, and steady-state step time compiled vs eager.

    PYTHONPATH=. python benchmarks/kernels/bench_compile.py --factory tests.compile_fixtures.standin:build_standin \\
        --backend inductor --mode blocks --batch 8 --seq 128 --steps 20

`--factory module:function` builds the model (keyword arguments from `--factory-kwargs` JSON); it must
follow the HybridLM contract (``blocks``, ``tok_embed``; ``model(idx, targets, doc_ids)`` -> loss).
Cold and warm compiles run in two fresh processes that share one Inductor cache directory (the first
fills it, the second reads it). Steady state runs in a third process: eager, compiled, and the seed's
alternative — compiled with the mixers of `--disable-kinds` (default M) wrapped in
``torch.compiler.disable``, one graph break per such block — each timed as forward+backward
(median over `--steps` after `--warmup` steps; bf16 autocast on GPU). The table is printed last.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

import torch

from megacpp.compile.cache import setup_inductor_cache
from megacpp.compile.config import CompileConfig
from megacpp.compile.cudagraphs import begin_graph_step
from megacpp.compile.health import CompileHealth, bounds_for
from megacpp.compile.regions import compile_model
from megacpp.compile.report import random_token_batch
from megacpp.versions import torch_version


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--factory", default="tests.compile_fixtures.standin:build_standin")
    p.add_argument("--factory-kwargs", default="{}", help="JSON keyword arguments for the factory")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--mode", default="blocks", choices=["model", "blocks"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--disable-kinds", default="M", help="block kinds whose mixers the seed variant disables")
    p.add_argument("--cache-dir", default="", help="cache root shared by the cold and warm runs (default: temp)")
    p.add_argument("--child", choices=["compile", "steady"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    module, _, name = args.factory.partition(":")
    torch.manual_seed(0)
    return getattr(importlib.import_module(module), name)(**json.loads(args.factory_kwargs)).to(device)


def make_step(args: argparse.Namespace, model: torch.nn.Module, device: torch.device):
    batch = random_token_batch(model.tok_embed.num_embeddings, args.batch, args.seq, device)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else nullcontext()

    def step() -> float:
        start = time.perf_counter()
        begin_graph_step()  # as the trainer does: replayed regions (compile.cudagraphs) start a generation here
        with autocast:
            loss = model(**batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return step


def child_compile(args: argparse.Namespace, device: torch.device) -> dict:
    setup_inductor_cache(args.cache_dir)
    cfg = CompileConfig(mode=args.mode, backend=args.backend)
    with CompileHealth(bounds_for(cfg)) as health:
        model = build(args, device)
        health.attach(compile_model(model, cfg))
        first = make_step(args, model, device)()
        totals = health.totals()
        counters = torch._dynamo.utils.counters
        return {"first_step_s": first, "compile_s": totals.compile_time_s, "graphs": totals.graphs,
                "breaks": len(health.break_sites()), "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
                "aot_hits": counters["aot_autograd"]["autograd_cache_hit"]}


def timed(args: argparse.Namespace, step) -> float:
    for _ in range(args.warmup):
        step()
    return statistics.median(step() for _ in range(args.steps))


def child_steady(args: argparse.Namespace, device: torch.device) -> dict:
    setup_inductor_cache(args.cache_dir)
    cfg = CompileConfig(mode=args.mode, backend=args.backend)
    eager = build(args, device)
    results = {"eager": {"step_s": timed(args, make_step(args, eager, device)), "breaks": 0}}
    for variant in ("compiled", "seed"):
        model = build(args, device)
        if variant == "seed":  # the seed's choice: black-box these mixers, one break per such block
            for block in model.blocks:
                if block.kind in args.disable_kinds:
                    block.mixer.forward = torch.compiler.disable(block.mixer.forward)
        with CompileHealth(bounds_for(cfg)) as health:
            health.attach(compile_model(model, cfg))
            step_s = timed(args, make_step(args, model, device))
            results[variant] = {"step_s": step_s, "breaks": len(health.break_sites()),
                                "recompiles": health.totals().recompiles_after_warmup}
    return results


def run_child(args: argparse.Namespace, kind: str) -> dict:
    argv = [f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items() if key != "child"]
    out = subprocess.run([sys.executable, __file__, *argv, f"--child={kind}"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"{kind} child failed with exit code {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.child:
        result = child_compile(args, device) if args.child == "compile" else child_steady(args, device)
        print(json.dumps(result))
        return
    args.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="megacpp-bench-cache-")
    cold = run_child(args, "compile")  # fills the shared cache
    warm = run_child(args, "compile")  # a fresh process reading it
    steady = run_child(args, "steady")

    tokens = args.batch * args.seq
    eager_s = steady["eager"]["step_s"]
    rows = [["measurement", "seconds", "ms/step", "tok/s", "vs eager", "graphs", "break sites", "cache hits fx/aot"]]
    for name, r in (("compile, cold cache (first step)", cold), ("compile, warm cache (first step)", warm)):
        rows.append([name, f"{r['first_step_s']:.2f}", "", "", "", str(r["graphs"]), str(r["breaks"]),
                     f"{r['fx_hits']}/{r['aot_hits']}"])
    labels = {"eager": "step, eager", "compiled": f"step, compiled ({args.mode})",
              "seed": f"step, compiled, {args.disable_kinds} mixers disabled (seed)"}
    for key, label in labels.items():
        r = steady[key]
        rows.append([label, "", f"{r['step_s'] * 1e3:.2f}", f"{tokens / r['step_s']:.0f}",
                     f"{eager_s / r['step_s']:.2f}x", "", str(r["breaks"]), ""])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"bench_compile: {args.factory} {args.factory_kwargs} backend={args.backend} mode={args.mode} "
          f"batch={args.batch}x{args.seq} device={name} torch={torch_version()} cache={args.cache_dir}")
    print(table(rows))


if __name__ == "__main__":
    main()
