"""Mamba-3 on a GPU: the fused Triton scan (megacpp/ops/mamba3_triton.py) against the pure-PyTorch
reference, then the M mixer's forward + backward time for each scan implementation.

    python benchmarks/kernels/bench_mamba3.py                      # small's sizes: d_model 768, B16 x T2048
    PYTHONPATH=.:.peers/mamba_src python benchmarks/kernels/bench_mamba3.py   # also times mamba_ssm's Mamba3

1. Correctness at small's mixer sizes (24 heads x 64, d_state 128, 1 group, 32 angles, chunk 64) on
   random inputs (--check-batch x --check-seq, documents of --doc-len tokens, an initial state):
   output, final state and every gradient of the fused op, Triton and reference path, against the
   float64 reference; max |error| / max |float64 reference| per tensor, the worst of each next to its
   bound. float32 inputs with fp32 matmuls: bound 1e-4 (tests/test_mamba3_fused.py derives it). bf16
   x, z with bf16 matmul operands (scan_matmuls = "activation"): bound 4 bf16 roundoffs, 4 * 2^-8,
   the bf16-matmul reference's own bound (tests/test_mamba3_scan.py). Then whether two Triton runs give
   bitwise identical results (the backward has no atomics).
2. Speed: the M mixer (d_model --d-model, small's Mamba3Config), forward + backward under bf16
   autocast, compiled like a `blocks` run, CUDA events, warmup then the median of --iters runs, for
   the reference scan (scan_matmuls fp32 and activation) and the Triton scan (both settings; with
   documents and eager for bf16), and mamba_ssm's Mamba3 SISO layer in the same process when it
   imports. `--only Triton` (words of the variant names) times a subset of megacpp's variants; the
   anchor runs regardless. Prints a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import torch._dynamo
from timing import fwd_bwd_ms, graph_breaks  # benchmarks/kernels/timing.py (the script's directory is on sys.path)

from megacpp.compile.cache import setup_inductor_cache
from megacpp.model.mamba3 import Mamba3
from megacpp.model.mamba3_config import Mamba3Config
from megacpp.model.mamba3_convert import config_to_mamba_ssm
from megacpp.model.segments import Segments, document_segments
from megacpp.ops.mamba3_fused import mamba3_fused_scan

SMALL = Mamba3Config(d_state=128, expand=2, head_dim=64, n_groups=1, chunk_size=64)
F32_BOUND = 1e-4
# (name, scan_kernel, scan_matmuls, with 512-token documents, compiled)
VARIANTS = [
    ("reference scan, fp32 matmuls, compiled", "reference", "fp32", False, True),
    ("reference scan, bf16 matmuls, compiled", "reference", "activation", False, True),
    ("Triton scan, fp32 matmuls, compiled", "triton", "fp32", False, True),
    ("Triton scan, bf16 matmuls, compiled", "triton", "activation", False, True),
    ("Triton scan, bf16 matmuls, compiled, doc_ids", "triton", "activation", True, True),
    ("Triton scan, bf16 matmuls, eager", "triton", "activation", False, False),
]
BF16_BOUND = 4 * 2.0**-8


def scan_inputs(b: int, t: int, h: int, g: int, p: int, n: int, na: int, doc_len: int, dev: torch.device,
                act: torch.dtype) -> tuple[dict, tuple, torch.Tensor, dict]:
    """The fused op's inputs distributed like the mixer's (unit-RMS B/C, biases near 1, decays in
    (0, 1)), an initial state, doc ids and cotangents."""
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, device=dev)

    dt = 0.001 + 0.1 * rand(b, t, h)
    inp = {
        "x": randn(b, t, h, p).to(act), "z": randn(b, t, h, p).to(act), "B": randn(b, t, g, n),
        "C": randn(b, t, g, n), "B_bias": 1 + 0.1 * randn(h, n), "C_bias": 1 + 0.1 * randn(h, n),
        "theta": (torch.pi * torch.tanh(randn(b, t, 1, na)) * dt[..., None]).cumsum(1),
        "adt": -(0.5 + 8 * rand(b, t, h)) * dt, "dt": dt, "lam": rand(b, t, h), "D": randn(h),
    }
    state = (randn(b, h, p, n), randn(b, h, n), randn(b, h, p).to(act))
    doc_ids = (torch.arange(t, device=dev) // doc_len).expand(b, t).contiguous()
    cot = {"y": randn(b, t, h, p).to(act).float(), "H": randn(b, h, p, n)}
    return inp, state, doc_ids, cot


def results(kernel: str, inp: dict, state: tuple, doc_ids: torch.Tensor, cot: dict, chunk: int,
            matmul_dtype: torch.dtype | None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Output, final state and gradients of every input (cast to dtype when given)."""
    leaves = {k: v.detach().to(dtype or v.dtype).requires_grad_() for k, v in inp.items()}
    init = tuple(s.detach().to(dtype or s.dtype).requires_grad_() for s in state)
    y, (H, _, _) = mamba3_fused_scan(**leaves, doc_ids=doc_ids, initial_state=init, chunk_size=chunk,
                                     return_final_state=True, matmul_dtype=matmul_dtype, kernel=kernel)
    work = torch.promote_types(H.dtype, torch.float32)
    loss = (y.to(work) * cot["y"].to(work)).sum() + (H * cot["H"].to(work)).sum()
    grads = torch.autograd.grad(loss, [*leaves.values(), *init])
    names = [*leaves, "H0", "B_prev0", "x_prev0"]
    return {"y": y.detach(), "H": H.detach(), **dict(zip(names, grads, strict=True))}


def relative_errors(got: dict, ref: dict) -> dict[str, float]:
    return {k: ((got[k].double() - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref}


def check(args: argparse.Namespace, dev: torch.device, cfg: Mamba3Config) -> None:
    h, p, n = cfg.expand * args.d_model // cfg.head_dim, cfg.head_dim, cfg.d_state
    na = n // 4  # rope_fraction 0.5: half the state dimensions rotate, in pairs
    b, t, chunk = args.check_batch, args.check_seq, cfg.chunk_size
    print(f"check: B{b} x T{t}, {h} heads x {p}, d_state {n}, {na} angles, chunk {chunk}, "
          f"documents of {args.doc_len} tokens, initial state")
    for label, act, mm, bound in (("fp32 inputs, fp32 matmuls", torch.float32, None, F32_BOUND),
                                  ("bf16 x/z, bf16 matmuls", torch.bfloat16, torch.bfloat16, BF16_BOUND)):
        inp, state, doc_ids, cot = scan_inputs(b, t, h, cfg.n_groups, p, n, na, args.doc_len, dev, act)
        exact = results("reference", inp, state, doc_ids, cot, chunk, None, torch.float64)
        print(f"  {label} (bound {bound:.1e} of max |float64 reference|):")
        for kernel in ("reference", "triton"):
            errors = relative_errors(results(kernel, inp, state, doc_ids, cot, chunk, mm), exact)
            worst = max(errors, key=errors.get)
            verdict = "ok" if errors[worst] <= bound else "FAIL"
            detail = " ".join(f"{k}={v:.1e}" for k, v in errors.items())
            print(f"    {kernel:<9} worst {worst} {errors[worst]:.2e} [{verdict}]   {detail}")
        first = results("triton", inp, state, doc_ids, cot, chunk, mm)
        second = results("triton", inp, state, doc_ids, cot, chunk, mm)
        same = all(torch.equal(first[k], second[k]) for k in first)
        print(f"    triton rerun bitwise identical: {'yes' if same else 'NO'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--check-batch", type=int, default=2)
    p.add_argument("--check-seq", type=int, default=1000)
    p.add_argument("--doc-len", type=int, default=300, help="document length of the doc_ids rows")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--chunk-size", type=int, default=SMALL.chunk_size,
                   help="the scan's chunk (both implementations; the Triton kernels take 16, 32, 64 or 128)")
    p.add_argument("--only", nargs="*",
                   help="time only the megacpp variants whose name contains one of these words "
                        "(the mamba_ssm anchor always runs when it imports)")
    args = p.parse_args()
    setup_inductor_cache()  # as `megacpp train` does: keyed by the ops' source, shared with training runs
    dev = torch.device("cuda")
    cfg = dataclasses.replace(SMALL, chunk_size=args.chunk_size)
    if not args.skip_check:
        check(args, dev, cfg)

    d, b, t = args.d_model, args.batch, args.seq
    x = torch.randn(b, t, d, device=dev, requires_grad=True)
    segments = document_segments((torch.arange(t, device=dev) // 512).expand(b, t).contiguous())  # 512-token docs
    rows: list[tuple[str, float, str, float]] = []

    def run(name: str, module: torch.nn.Module, docs: Segments | None, compiled: bool) -> None:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        module = module.to(dev)
        torch.nn.init.normal_(module.out_proj.weight, std=d**-0.5)  # zero at init: no grads upstream
        target = torch.compile(module) if compiled else module
        torch.cuda.reset_peak_memory_stats()
        ms = fwd_bwd_ms(target, *((x,) if docs is None else (x, docs)), iters=args.iters)
        breaks = str(graph_breaks()) if compiled else "-"
        rows.append((name, ms, breaks, torch.cuda.max_memory_allocated() / 2**30))
        print(f"{name}: {ms:.2f} ms (graph breaks {breaks})", flush=True)

    def wanted(name: str) -> bool:
        return not args.only or any(word in name for word in args.only)

    for name, kernel, matmuls, docs, compiled in VARIANTS:
        if not wanted(name):
            continue
        torch.manual_seed(0)
        variant = dataclasses.replace(cfg, scan_kernel=kernel, scan_matmuls=matmuls)
        run(f"M {name}", Mamba3(d, variant, 0), segments if docs else None, compiled)
    peer = "mamba_ssm Mamba3 (Triton), eager"
    try:
        from mamba_ssm.modules.mamba3 import Mamba3 as PeerMamba3
    except Exception as exc:  # the peer is optional: say why it is missing
        print(f"{peer}: not timed, {type(exc).__name__}: {exc}", file=sys.stderr)
    else:  # the anchor: timed whatever --only selects, so every call measures its ratio to it
        # The anchor stays at small's own sizes (chunk 64) whatever --chunk-size asks of megacpp's scans.
        run(f"M {peer}", PeerMamba3(**config_to_mamba_ssm(d, SMALL), device=dev), None, False)

    tokens = b * t
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | M mixer d_model {d}, B{b} x T{t}, "
          f"chunk {cfg.chunk_size}, bf16 autocast, fwd+bwd")
    print(f"{'variant':<52}{'ms':>9}{'Mtok/s':>9}{'breaks':>8}{'peak GiB':>10}")
    for name, ms, breaks, peak in rows:
        print(f"{name:<52}{ms:>9.2f}{tokens / ms / 1e3:>9.2f}{breaks:>8}{peak:>10.1f}")


if __name__ == "__main__":
    main()
