"""Muon step time on the 72 hidden matrices of a d12-sized model, against torch.optim.Muon.

d12: 12 layers x (4 attention matrices 768x768, MLP up 3072x768, MLP down 768x3072) = 48 + 12 + 12.
Variants, all in the same run on the same parameters and gradients:
  torch.optim.Muon                torch's reference (quintic, per-matrix loop)
  megacpp torch-compatible        the configuration that reproduces torch.optim.Muon's update
  megacpp default                 Polar Express + variance reduction + cautious decay + bf16 momentum
  megacpp default, compiled       the same step as one torch.compile graph
GPU: CUDA events, warmup then the median of N steps. CPU: wall clock median; --quick shrinks the
model 6x per side (d=128) and the step counts so it finishes in about a minute on 2 cores.

    python benchmarks/kernels/bench_muon.py            # GPU (or full size on CPU)
    python benchmarks/kernels/bench_muon.py --quick --threads 1   # CPU smoke run
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from timing import median_ms  # benchmarks/kernels/timing.py (the script's directory is on sys.path)
from torch import nn

from megacpp.compile.cache import setup_inductor_cache
from megacpp.optim import Muon, torch_muon_compatible


def d12_matrices(d: int, layers: int, device: torch.device) -> list[nn.Parameter]:
    shapes = [(d, d)] * 4 * layers + [(4 * d, d)] * layers + [(d, 4 * d)] * layers
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = nn.Parameter((torch.randn(shape, generator=gen) / shape[1] ** 0.5).to(device))
        p.grad = torch.randn(shape, generator=gen).to(device)
        params.append(p)
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="d=128 and few steps (CPU smoke run)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled variant")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (1 is steadier on a shared host)")
    args = parser.parse_args()
    setup_inductor_cache()  # as `megacpp train` does: keyed by the ops' source, shared with training runs
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = 128 if args.quick else 768
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    iters = args.iters if args.iters is not None else (10 if args.quick else 50)
    lr, wd = 0.02, 0.01

    params = d12_matrices(d, 12, device)
    n_params = sum(p.numel() for p in params)
    variants: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
        "torch.optim.Muon": lambda ps: torch.optim.Muon(ps, lr=lr, weight_decay=wd),
        "megacpp torch-compatible": lambda ps: torch_muon_compatible(ps, lr=lr, weight_decay=wd),
        "megacpp default": lambda ps: Muon(ps, lr=lr, weight_decay=wd),
        "megacpp default, compiled": lambda ps: Muon(
            ps, lr=lr, weight_decay=wd, compile_step=True, compile_backend=args.backend
        ),
    }
    results: dict[str, float] = {}
    copies: dict[str, list[nn.Parameter]] = {}
    for name, build in variants.items():
        ps = [nn.Parameter(p.detach().clone()) for p in params]
        for p, src in zip(ps, params, strict=True):
            p.grad = src.grad.clone()
        opt = build(ps)
        t0 = time.perf_counter()
        opt.step()  # first step: state allocation (and compilation for the compiled variant)
        if device.type == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        results[name] = median_ms(opt.step, device, warmup, iters)
        copies[name] = ps
        print(f"{name}: first step {first:.2f} s", flush=True)

    steps = 1 + warmup + iters
    drift = max(
        (a - b).abs().max().item()
        for a, b in zip(copies["torch.optim.Muon"], copies["megacpp torch-compatible"], strict=True)
    )
    ref = results["torch.optim.Muon"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"\ntorch {torch.__version__} | {name} | {len(params)} matrices, {n_params / 1e6:.1f}M params (d={d})")
    print(f"torch-compatible vs torch.optim.Muon after {steps} identical steps: max |diff| = {drift:.3g}")
    print(f"{'variant':<28}{'ms/step':>10}{'vs torch':>10}")
    for variant, ms in results.items():
        print(f"{variant:<28}{ms:>10.2f}{ref / ms:>9.2f}x")


if __name__ == "__main__":
    main()
