"""The routed experts' Newton-Schulz cost per optimizer step, by iteration count (`optim.expert_ns_steps`).

Times `orthogonalize` on one E layer's stacked w_up and w_down at a preset's shapes, compiled as Muon's step
runs it, and multiplies by the preset's E layers: the experts' share of one GPU's optimizer step. Under FSDP2
or expert parallelism each rank orthogonalizes only the experts it holds, so divide by the ranks holding
distinct experts. The whole step's figure is `megacpp train`'s profile (BENCHMARKS.md, E3).

Each variant (iterations x `optim.muon_gram_kernel`) is timed two ways on a GPU: from an idle GPU (each call
between two syncs, the host's launches included: at `small`'s stacks the Gram kernel's launches bound it) and
as device time (`timing.device_ms`: the calls queued behind a GPU spin, the host hidden, as in the training
step). On a CPU the iterations take the epilogue form, where the Gram kernel setting changes nothing.

    python benchmarks/kernels/bench_expert_orthogonalize.py                       # small and nam52: 5, 4, 3
    python benchmarks/kernels/bench_expert_orthogonalize.py --device cpu --scale 16 --iters 2   # smoke run
"""
from __future__ import annotations

import argparse

import torch
from timing import device_ms, median_ms  # benchmarks/kernels/timing.py (the script's directory is on sys.path)

from megacpp.model.pattern import expand_pattern
from megacpp.optim.orthogonalize import orthogonalize
from megacpp.presets import preset


def expert_stacks(name: str, scale: int) -> tuple[list[tuple[int, int, int]], int]:
    """One E layer's (w_up, w_down) stack shapes and the number of E layers of preset `name`; `scale` divides
    the experts and both widths (a smaller stand-in for a CPU)."""
    model = preset(name).model
    experts, d, hidden = (max(1, size // scale) for size in (model.moe.n_experts, model.d_model,
                                                             model.moe.expert_hidden))
    return [(experts, d, hidden), (experts, hidden, d)], expand_pattern(model.pattern, model.depth).count("E")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="small,nam52", help="comma-separated presets with E blocks")
    ap.add_argument("--steps", default="5,4,3", help="comma-separated Newton-Schulz iteration counts")
    ap.add_argument("--gram-kernels", default="auto,reference",
                    help="comma-separated `optim.muon_gram_kernel` choices (default auto,reference)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=int, default=1, help="divide experts and widths by this (CPU smoke runs)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per variant (the median is reported)")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for name in args.presets.split(","):
        shapes, layers = expert_stacks(name, args.scale)
        gen = torch.Generator().manual_seed(0)
        stacks = [torch.randn(shape, generator=gen).to(device) for shape in shapes]
        for steps in (int(s) for s in args.steps.split(",")):
            for kernel in args.gram_kernels.split(","):
                layer = torch.compile(lambda gs, steps=steps, kernel=kernel: [
                    orthogonalize(g, steps=steps, gram_kernel=kernel) for g in gs], fullgraph=True)

                def call(layer=layer, stacks=stacks) -> None:
                    layer(stacks)

                idle = median_ms(call, device, warmup=3, iters=args.iters)
                queued = device_ms(call, device, warmup=1, iters=args.iters) if device.type == "cuda" else None
                rows.append((name, " + ".join("x".join(map(str, s)) for s in shapes), layers, steps, kernel, idle,
                             queued))
    print(f"{'preset':<8}{'stacks per E layer':<30}{'E layers':>9}{'iterations':>11}{'Gram':>10}"
          f"{'ms per layer':>14}{'device ms':>11}{'ms per step':>13}{'device ms':>11}")
    print(f"{'':<82}{'(per layer)':>11}{'':>13}{'(per step)':>11}")
    for name, shapes, layers, steps, kernel, idle, queued in rows:
        device_cols = f"{queued:>11.3f}" if queued is not None else f"{'-':>11}"
        device_step = f"{queued * layers:>11.1f}" if queued is not None else f"{'-':>11}"
        print(f"{name:<8}{shapes:<30}{layers:>9}{steps:>11}{kernel:>10}{idle:>14.3f}{device_cols}"
              f"{idle * layers:>13.1f}{device_step}")


if __name__ == "__main__":
    main()
