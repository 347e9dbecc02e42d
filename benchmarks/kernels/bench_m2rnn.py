"""M2RNN (R) on a GPU: the exact path (bitwise mode's kernels, megacpp/ops/m2rnn_triton.py) against the fast
path (the default on CUDA, megacpp/ops/m2rnn_triton_fast.py), at `small`'s R sizes by default.

    python benchmarks/kernels/bench_m2rnn.py                                  # about 3 minutes on an H100
    TRITON_INTERPRET=1 python benchmarks/kernels/bench_m2rnn.py --dry-run     # tiny sizes on CPU: checks the script

1. Check (B --check-batch x T --check-seq, the bench's heads and dims, inputs distributed like the
   mixer's): every output of the exact kernels and of each fast variant against the float64 reference,
   as max |diff| / max |float64| in units of the variant's unit roundoff u (2^-11 forward; 2^-8 for
   gradients through bf16 operands); the default fast variant run twice (bitwise equal or not); the
   default against the exact kernels (max |fast - exact| / max |exact| per output).
2. Scan ops (B --batch x T --seq, float32, no last-state gradient as in training): forward, backward and
   both, in ms (median of --iters after warmup), for the exact kernels, each fast variant
   (precision x states x backward) and the launch alternatives of m2rnn_triton_fast.FastTuning.
   The fast default also at value_dim 32 and 64 (--other-values).
3. The R mixer compiled (Inductor) under bf16 autocast: forward, backward and both, in ms, and peak
   memory, for the exact path and the fast default at --value-dim (16, `small`'s), and the fast default at
   the other widths: what the value width costs in speed.
Prints a table last. The fast default is what `m2rnn_scan` runs in fast mode (m2rnn_scan.FAST_SCAN and
m2rnn_triton_fast.TUNING); a faster row of section 2 is the candidate for those defaults.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timing import median_ms  # benchmarks/kernels/timing.py (the script's directory is on sys.path)

from megacpp.model.m2rnn import M2RNN
from megacpp.model.m2rnn_config import M2RNNConfig
from megacpp.ops import m2rnn_scan as scan_ops
from megacpp.ops import m2rnn_triton, m2rnn_triton_fast
from megacpp.ops.m2rnn_scan import _scan_bwd_reference, _scan_fwd_reference

OUTPUTS = ["y", "last", "grad_q", "grad_k", "grad_v", "grad_f", "grad_W", "grad_h0"]


@dataclass(frozen=True)
class Variant:
    """One way to run the scan ops: the exact kernels, or the fast ones with a precision and a tuning."""

    name: str
    exact: bool = False
    half_dot: bool = True
    half_states: bool = True
    tuning: m2rnn_triton_fast.FastTuning = dataclasses.field(default_factory=m2rnn_triton_fast.FastTuning)

    def u(self, output: str) -> float:
        if self.exact:
            return 2.0**-24
        return 2.0**-8 if self.half_dot and output.startswith("grad") else 2.0**-11


def variants() -> list[Variant]:
    """The exact kernels, the fast default, the other precisions and backward plans, then launch
    alternatives of the default (indented names)."""
    def tuned(**changes: int | bool) -> m2rnn_triton_fast.FastTuning:
        return dataclasses.replace(m2rnn_triton_fast.FastTuning(), **changes)

    return [
        Variant("exact: tf32x3, fp32 states", exact=True),
        Variant("fast default: fp16/bf16 dots, fp16 states, fused bwd"),
        Variant("fast: fp16/bf16, fp16 states, split bwd 1 warp", tuning=tuned(fused_backward=False, bwd_warps=1)),
        Variant("fast: fp16/bf16, fp16 states, split bwd 4 warps", tuning=tuned(fused_backward=False)),
        Variant("fast: fp16/bf16, fp32 states, fused bwd", half_states=False),
        Variant("fast: tf32, fp16 states, fused bwd", half_dot=False),
        Variant("fast: tf32, fp32 states, split bwd 1 warp", half_dot=False, half_states=False,
                tuning=tuned(fused_backward=False, bwd_warps=1)),
        Variant("  default, fwd 2 warps", tuning=tuned(fwd_warps=2)),
        Variant("  default, fwd 4 warps", tuning=tuned(fwd_warps=4)),
        Variant("  default, fused bwd 2 warps", tuning=tuned(bwd_warps=2, narrow_bwd_warps=2)),
        Variant("  default, fused bwd 4 warps", tuning=tuned(bwd_warps=4, narrow_bwd_warps=4)),
        Variant("  default, fused bwd 1 warp at every width", tuning=tuned(bwd_warps=1, narrow_bwd_warps=1)),
        Variant("  default, 32 rows, fwd 2 / bwd 4 warps", tuning=tuned(block=32, fwd_warps=2)),
        Variant("  default, 2 stages", tuning=tuned(stages=2)),
        Variant("  default, 4 stages", tuning=tuned(stages=4)),
        Variant("  default, exact tanh formula", tuning=tuned(approx_tanh=False)),
    ]


@contextlib.contextmanager
def tuning(value: m2rnn_triton_fast.FastTuning) -> Iterator[None]:
    saved = m2rnn_triton_fast.TUNING
    m2rnn_triton_fast.TUNING = value
    try:
        yield
    finally:
        m2rnn_triton_fast.TUNING = saved


def scan_inputs(b: int, t: int, n_heads: int, dk: int, dv: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """The ops' float32 inputs, distributed like the mixer's (q, k unit-norm, f in (0, 1], W near the
    identity), and random cotangents for y and the last state."""
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev)

    q, k = (F.normalize(randn(b, t, n_heads, dk), dim=-1) for _ in range(2))
    v = randn(b, t, n_heads, dv)
    f = 1.0 - torch.rand(b, t, n_heads, generator=g, device=dev)
    W = torch.eye(dv, device=dev) + 0.1 * randn(n_heads, dv, dv) / dv**0.5
    h0 = 0.5 * torch.tanh(randn(n_heads, b, dk, dv))
    return q, k, v, f, W, h0, randn(t, n_heads, b, dv), randn(n_heads, b, dk, dv)


def run_scan(variant: Variant, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """y, the last state and the six gradients (the last state's included) from the variant's kernels."""
    q, k, v, f, W, h0, grad_y, grad_last = inputs
    if variant.exact:
        y, states = m2rnn_triton.scan_fwd_triton(q, k, v, f, W, h0)
        grad_states = torch.zeros_like(states)
        grad_states[-1] = grad_last
        return [y, states[-1], *m2rnn_triton.scan_bwd_triton(q, k, v, f, W, h0, states, grad_y, grad_states)]
    with tuning(variant.tuning):
        y, last, states = m2rnn_triton_fast.scan_fwd_fast(q, k, v, f, W, h0, variant.half_dot, variant.half_states)
        grads = m2rnn_triton_fast.scan_bwd_fast(q, k, v, f, W, states, grad_y, grad_last, variant.half_dot)
    return [y, last, *grads]


def float64_reference(inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    q, k, v, f, W, h0, grad_y, grad_last = (x.double() for x in inputs)
    y, states = _scan_fwd_reference(q, k, v, f, W, h0)
    grad_states = torch.zeros_like(states)
    grad_states[-1] = grad_last
    return [y, states[-1], *_scan_bwd_reference(q, k, v, f, W, h0, states, grad_y, grad_states)]


def check(args: argparse.Namespace, dev: torch.device, all_variants: list[Variant]) -> None:
    inputs = scan_inputs(args.check_batch, args.check_seq, args.heads, args.key_dim, args.value_dim, dev)
    ref = float64_reference(inputs)
    print(f"check: B{args.check_batch} x T{args.check_seq}, {args.heads} heads x {args.key_dim} x {args.value_dim}; "
          "max |kernels - float64| / max |float64|, in units of u (2^-24 exact; fast: 2^-11, 2^-8 for gradients "
          "through bf16 operands)")
    print(f"  {'variant':<52}" + "".join(f"{name:>9}" for name in OUTPUTS))
    for variant in all_variants:
        out = run_scan(variant, inputs)
        rel = [((a.double() - r).abs().max() / r.abs().max()).item() / variant.u(name)
               for name, a, r in zip(OUTPUTS, out, ref, strict=True)]
        print(f"  {variant.name:<52}" + "".join(f"{x:>9.3g}" for x in rel), flush=True)
    exact, default = all_variants[:2]
    first, second, baseline = run_scan(default, inputs), run_scan(default, inputs), run_scan(exact, inputs)
    same = all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    print(f"  {default.name}, run twice: {'bitwise identical' if same else 'DIFFERENT'}")
    print("  fast default against the exact kernels, max |fast - exact| / max |exact|: " + ", ".join(
        f"{name} {((a - r).abs().max() / r.abs().max()).item():.2e}"
        for name, a, r in zip(OUTPUTS, first, baseline, strict=True)), flush=True)


def time_scan(variant: Variant, inputs: tuple[torch.Tensor, ...], dev: torch.device,
              args: argparse.Namespace) -> tuple[float, float, float]:
    """(forward, backward, forward + backward) ms of the scan ops, no last-state gradient (training)."""
    q, k, v, f, W, h0, grad_y, grad_last = inputs

    if variant.exact:
        def forward() -> torch.Tensor:
            return m2rnn_triton.scan_fwd_triton(q, k, v, f, W, h0)[1]

        def backward(states: torch.Tensor) -> None:
            m2rnn_triton.scan_bwd_triton(q, k, v, f, W, h0, states, grad_y, states.new_empty(0))
    else:
        def forward() -> torch.Tensor:
            return m2rnn_triton_fast.scan_fwd_fast(q, k, v, f, W, h0, variant.half_dot, variant.half_states)[2]

        def backward(states: torch.Tensor) -> None:
            m2rnn_triton_fast.scan_bwd_fast(q, k, v, f, W, states, grad_y, grad_last[:0], variant.half_dot)

    with tuning(variant.tuning):
        states = forward()
        times = tuple(median_ms(step, dev, args.warmup, args.iters)
                      for step in (forward, lambda: backward(states), lambda: backward(forward())))
    return times


@contextlib.contextmanager
def scan_path(fast: bool) -> Iterator[None]:
    """The mixer's scan on the fast or the exact path whatever the device and mode (on CPU the fast op
    runs its reference): what bitwise mode picks for R, without bitwise mode's other settings."""
    saved = scan_ops.uses_fast_scan
    scan_ops.uses_fast_scan = lambda device_type, dtype, dk, dv: fast and saved("cuda", dtype, dk, dv)
    torch._dynamo.reset()
    try:
        yield
    finally:
        scan_ops.uses_fast_scan = saved
        torch._dynamo.reset()


def time_mixer(args: argparse.Namespace, dev: torch.device, value_dim: int, fast: bool,
               backend: str) -> tuple[float, float, float, float]:
    """(forward, backward, forward + backward) ms and peak GiB of the compiled R mixer under bf16 autocast.
    The backward is the difference of the other two: it cannot run without its forward."""
    torch.manual_seed(0)
    cfg = M2RNNConfig(n_heads=args.heads, key_dim=args.key_dim, value_dim=value_dim)
    module = M2RNN(args.d_model, cfg, 0).to(dev)
    torch.nn.init.normal_(module.out_proj.weight, std=args.d_model**-0.5)  # zero at init: no grads upstream
    x = torch.randn(args.batch, args.seq, args.d_model, device=dev, requires_grad=True)
    with scan_path(fast):
        compiled = torch.compile(module, backend=backend)

        def forward() -> torch.Tensor:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                return compiled(x)

        def both() -> None:
            forward().float().sum().backward()

        both()  # compile both directions before timing
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        fwd = median_ms(forward, dev, args.warmup, args.iters)
        total = median_ms(both, dev, args.warmup, args.iters)
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    return fwd, total - fwd, total, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--key-dim", type=int, default=64)
    p.add_argument("--value-dim", type=int, default=16, help="`small`'s width (default 16)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    # Multiples of 16, like --batch and --seq: Triton specializes its kernels on that, so the check and
    # the timing share their compiled kernels (the interpreter tests cover odd sizes).
    p.add_argument("--check-batch", type=int, default=16)
    p.add_argument("--check-seq", type=int, default=256)
    p.add_argument("--other-values", type=int, nargs="*", default=[32, 64],
                   help="other value widths timed beside --value-dim, scan ops and compiled mixer (default 32 64)")
    p.add_argument("--skip-sweep", action="store_true", help="time only the exact and the default scan ops")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes on CPU (run under TRITON_INTERPRET=1), mixer on aot_eager: checks the script")
    args = p.parse_args()
    backend = "inductor"
    if args.dry_run:
        dims = dict(d_model=32, heads=2, key_dim=16, value_dim=32, batch=2, seq=8, iters=1, warmup=0, check_batch=1,
                    check_seq=5, other_values=[16])
        for name, value in dims.items():
            setattr(args, name, value)
        dev, backend = torch.device("cpu"), "aot_eager"
    else:
        dev = torch.device("cuda")
    all_variants = variants()
    check(args, dev, all_variants)

    scan_rows = []
    runs = [(variant, args.value_dim) for variant in (all_variants[:2] if args.skip_sweep else all_variants)]
    runs += [(all_variants[1], value_dim) for value_dim in args.other_values]
    for variant, value_dim in runs:
        inputs = scan_inputs(args.batch, args.seq, args.heads, args.key_dim, value_dim, dev)
        times = time_scan(variant, inputs, dev, args)
        name = variant.name if value_dim == args.value_dim else f"{variant.name}, value_dim {value_dim}"
        scan_rows.append((name, *times))
        print(f"scan ops, {name}: forward {times[0]:.2f}, backward {times[1]:.2f}, both {times[2]:.2f} ms",
              flush=True)
        del inputs

    mixer_rows: list[tuple[str, float, float, float, float]] = []
    mixer_runs = [(args.value_dim, False), (args.value_dim, True)] + [(dv, True) for dv in args.other_values]
    for value_dim, fast in mixer_runs:
        name = f"{'fast default' if fast else 'exact'}, value_dim {value_dim}"
        times = time_mixer(args, dev, value_dim, fast, backend)
        mixer_rows.append((name, *times))
        print(f"R mixer, {name}: forward {times[0]:.2f}, backward {times[1]:.2f}, both {times[2]:.2f} ms, "
              f"peak {times[3]:.1f} GiB", flush=True)

    device_name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (dry run)"
    print(f"\n{device_name} | torch {torch.__version__} | R: d_model {args.d_model}, {args.heads} heads x "
          f"{args.key_dim} x {args.value_dim}, B{args.batch} x T{args.seq}")
    print(f"{'scan ops, float32':<68}{'fwd ms':>9}{'bwd ms':>9}{'both ms':>9}")
    for name, fwd, bwd, both in scan_rows:
        print(f"{name:<68}{fwd:>9.2f}{bwd:>9.2f}{both:>9.2f}")
    print(f"{'R mixer, compiled, bf16 autocast':<68}{'fwd ms':>9}{'bwd ms':>9}{'both ms':>9}{'peak GiB':>10}")
    for name, fwd, bwd, both, peak in mixer_rows:
        print(f"{name:<68}{fwd:>9.2f}{bwd:>9.2f}{both:>9.2f}{peak:>10.1f}")


if __name__ == "__main__":
    main()
