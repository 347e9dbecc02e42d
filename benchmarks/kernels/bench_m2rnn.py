"""M2RNN on a GPU: the fused Triton scan (megacpp/ops/m2rnn_triton.py, the ops' CUDA kernel) against the
PyTorch reference loop (the same ops with the CUDA kernel disabled).

    python benchmarks/kernels/bench_m2rnn.py --d-model 768 --heads 6 --key-dim 64 --value-dim 64 --batch 16 --seq 2048

1. Correctness: the scan ops on random float32 inputs (--check-batch x --check-seq, the bench's heads
   and dims; q, k unit-norm, f in (0, 1], W near identity): max |triton - reference| of y, the states
   and the six gradients, next to max |reference|.
2. Speed: forward + backward of the M2RNN mixer under bf16 autocast, eager, CUDA events, warmup then the
   median of --iters runs, reference vs Triton. Prints a table last.
3. With --compare-with FILE (an older m2rnn_triton.py, e.g. from `git show REV:megacpp/ops/m2rnn_triton.py`):
   the raw scan ops at the bench's full size, that file's kernels against the current ones (max diff of
   every gradient, forward and backward ms, the backward's peak memory).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from timing import fwd_bwd_ms, median_ms  # benchmarks/kernels/timing.py (the script's directory is on sys.path)

from megacpp.model.m2rnn import M2RNN, M2RNNConfig
from megacpp.ops import m2rnn_triton
from megacpp.ops.m2rnn_scan import _scan_bwd, _scan_fwd

GRADS = ["grad_q", "grad_k", "grad_v", "grad_f", "grad_W", "grad_h0"]


@contextlib.contextmanager
def reference_path() -> Iterator[None]:
    """The ops' PyTorch reference on CUDA: the registered Triton kernels disabled."""
    with _scan_fwd.set_kernel_enabled("cuda", False), _scan_bwd.set_kernel_enabled("cuda", False):
        yield


def scan_inputs(b: int, t: int, n_heads: int, dk: int, dv: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """The ops' float32 inputs, distributed like the mixer's, and random cotangents for y and the states."""
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev)

    q, k = (F.normalize(randn(b, t, n_heads, dk), dim=-1) for _ in range(2))
    v = randn(b, t, n_heads, dv)
    f = 1.0 - torch.rand(b, t, n_heads, generator=g, device=dev)
    W = torch.eye(dv, device=dev) + 0.1 * randn(n_heads, dv, dv) / dv**0.5
    h0 = 0.5 * torch.tanh(randn(n_heads, b, dk, dv))
    return q, k, v, f, W, h0, randn(t, n_heads, b, dv), randn(t, n_heads, b, dk, dv)


def scan_outputs(inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    q, k, v, f, W, h0, grad_y, grad_states = inputs
    y, states = _scan_fwd(q, k, v, f, W, h0)
    grads = _scan_bwd(q, k, v, f, W, h0, states, grad_y, grad_states)
    return {"y": y, "states": states, **dict(zip(GRADS, grads, strict=True))}


def check(args: argparse.Namespace, dev: torch.device) -> None:
    inputs = scan_inputs(args.check_batch, args.check_seq, args.heads, args.key_dim, args.value_dim, dev)
    fast = scan_outputs(inputs)
    with reference_path():
        ref = scan_outputs(inputs)
    print(f"check: B{args.check_batch} x T{args.check_seq}, {args.heads} heads x {args.key_dim} x {args.value_dim}, "
          "float32")
    for name, r in ref.items():
        diff = (fast[name] - r).abs().max().item()
        print(f"  {name:<8} max |triton - reference| {diff:.3e}   max |reference| {r.abs().max().item():.3e}")


def compare_kernels(path: str, args: argparse.Namespace, dev: torch.device) -> None:
    spec = importlib.util.spec_from_file_location("m2rnn_triton_baseline", path)
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    q, k, v, f, W, h0, grad_y, grad_states = scan_inputs(
        args.batch, args.seq, args.heads, args.key_dim, args.value_dim, dev)
    _, states = m2rnn_triton.scan_fwd_triton(q, k, v, f, W, h0)
    bwd_args = (q, k, v, f, W, h0, states, grad_y, grad_states)
    old = baseline.scan_bwd_triton(*bwd_args)
    torch.cuda.reset_peak_memory_stats()
    new = m2rnn_triton.scan_bwd_triton(*bwd_args)
    peak_new = torch.cuda.max_memory_allocated() / 2**30
    print(f"compare: {path} vs current kernels, B{args.batch} x T{args.seq}, float32 scan ops")
    for name, a, b in zip(GRADS, old, new, strict=True):
        print(f"  {name:<8} max |current - baseline| {(a - b).abs().max().item():.3e}   "
              f"max |baseline| {a.abs().max().item():.3e}")
    for label, module in (("baseline", baseline), ("current", m2rnn_triton)):
        fwd = median_ms(lambda m=module: m.scan_fwd_triton(q, k, v, f, W, h0), dev, 2, args.iters)
        bwd = median_ms(lambda m=module: m.scan_bwd_triton(*bwd_args), dev, 2, args.iters)
        print(f"  {label:<8} scan forward {fwd:.2f} ms, backward {bwd:.2f} ms")
    print(f"  current backward's peak memory (inputs included): {peak_new:.1f} GiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--key-dim", type=int, default=64)
    p.add_argument("--value-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--check-batch", type=int, default=3)
    p.add_argument("--check-seq", type=int, default=512)
    p.add_argument("--compare-with", metavar="FILE", help="an older m2rnn_triton.py to time against")
    args = p.parse_args()
    dev = torch.device("cuda")
    check(args, dev)
    if args.compare_with:
        compare_kernels(args.compare_with, args, dev)

    torch.manual_seed(0)
    cfg = M2RNNConfig(n_heads=args.heads, key_dim=args.key_dim, value_dim=args.value_dim)
    module = M2RNN(args.d_model, cfg, 0).to(dev)
    torch.nn.init.normal_(module.out_proj.weight, std=args.d_model**-0.5)  # zero at init: no grads upstream
    x = torch.randn(args.batch, args.seq, args.d_model, device=dev, requires_grad=True)
    rows: list[tuple[str, float, float]] = []
    for name, path in (("reference (PyTorch loop)", reference_path), ("Triton fused scan", contextlib.nullcontext)):
        torch.cuda.reset_peak_memory_stats()
        with path():
            ms = fwd_bwd_ms(module, x, warmup=2, iters=args.iters)
        rows.append((name, ms, torch.cuda.max_memory_allocated() / 2**30))
        print(f"{name}: {ms:.2f} ms", flush=True)

    tokens = args.batch * args.seq
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | M2RNN d_model {args.d_model}, "
          f"{args.heads} heads x {args.key_dim} x {args.value_dim}, B{args.batch} x T{args.seq}, bf16 autocast")
    print(f"{'M2RNN mixer, fwd+bwd':<28}{'ms':>10}{'Mtok/s':>9}{'speedup':>9}{'peak GiB':>10}")
    for name, ms, peak in rows:
        print(f"{name:<28}{ms:>10.2f}{tokens / ms / 1e3:>9.2f}{rows[0][1] / ms:>8.1f}x{peak:>10.1f}")


if __name__ == "__main__":
    main()
