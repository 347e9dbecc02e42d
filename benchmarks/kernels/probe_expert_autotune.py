"""`small`'s E block (`Block("E")`: norm, `MoE` with the grouped dispatch, residual) compiled by default or under
Inductor's max-autotune GEMM templates, whose Triton `_grouped_mm` template could fuse relu² and the casts
into the grouped GEMMs' epilogues. One variant per process, so each compile starts cold:

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/kernels/probe_expert_autotune.py default dynamic
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/kernels/probe_expert_autotune.py template static

Prints the first forward + backward's wall time (the compile), the device time of a forward + backward
(`timing.device_ms`), the top kernels of a 3-step profile and, when a default run of the same batch marking
saved its results in /tmp, the largest differences from it. CUDA only.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch._dynamo

# benchmarks/kernels/timing.py (the script's directory is on sys.path)
from timing import device_ms, fwd_bwd_step, kernel_ms, randomize_zero_weights

from megacpp.compile.config import CompileConfig
from megacpp.compile.policy import apply_policy
from megacpp.model.hybrid import Block
from megacpp.presets import preset

OPTIONS = {
    "default": {},
    "template": {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON"},
    "template+aten": {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", choices=sorted(OPTIONS))
    p.add_argument("batch", choices=("dynamic", "static"), help="mark the batch axis dynamic, as training does")
    args = p.parse_args()
    apply_policy(CompileConfig())
    cfg = preset("small")
    dev = torch.device("cuda")
    d = cfg.model.d_model
    torch.manual_seed(0)
    block = Block("E", cfg.model, 1).to(dev)
    randomize_zero_weights(block, std=d**-0.5)
    x = torch.randn(16, 2048, d, device=dev, requires_grad=True)
    if args.batch == "dynamic":
        torch._dynamo.maybe_mark_dynamic(x, 0)
    options = OPTIONS[args.variant]
    step = fwd_bwd_step(torch.compile(block, options=options) if options else torch.compile(block), x)
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    ms = device_ms(step, dev, warmup=2, iters=20)

    x.grad = None
    block.zero_grad(set_to_none=True)
    step()
    got = {"grad_x": x.grad.float().cpu(), "grad_w_up": block.mixer.w_up.grad.float().cpu()}
    saved = Path(f"/tmp/probe_expert_autotune_default_{args.batch}.pt")
    if args.variant == "default":
        torch.save(got, saved)

    per_kernel = kernel_ms(step, dev)
    print(json.dumps({"variant": args.variant, "batch": args.batch, "compile_s": round(compile_s, 1),
                      "device_ms": round(ms, 3)}))
    for name, ms_per_call in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]:
        print(f"   {ms_per_call:8.3f} ms  {name[:90]}")
    if args.variant != "default" and saved.exists():
        ref = torch.load(saved)
        for name, value in got.items():
            print(f"   {name}: max |diff| from default {(ref[name] - value).abs().max().item():.3e}, "
                  f"max |default| {ref[name].abs().max().item():.3e}")


if __name__ == "__main__":
    main()
