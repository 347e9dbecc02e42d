"""The compiled M sublayer at `small`'s shapes with this tree's Mamba-3 kernels against other versions of
megacpp/ops/mamba3_triton.py, alternated in one process, and mamba_ssm's layer beside them.

    git show da7416c:megacpp/ops/mamba3_triton.py > /tmp/main_kernels.py
    PYTHONPATH=.:.peers/mamba_src python benchmarks/kernels/ab_mamba3_kernels.py --variant main=/tmp/main_kernels.py

Each --variant NAME=FILE loads FILE as a module of its own; its `fused_fwd` and `fused_bwd` stand in for the
tree's while that variant is timed (the compiled graph calls the ops `megacpp::mamba3_fused_fwd/_bwd`,
which look the kernels' module up at each call, so one compile serves every variant). Rounds alternate the
variants, so a drift of the GPU's clock reaches all of them. Device time (`timing.device_ms`), B16 × T2048,
512-token documents, bf16 autocast. --check first runs bench_mamba3's float64 check of this tree's
kernels; --profile adds each variant's Triton kernels, device ms per step. The variants' table prints as
soon as their rounds end, the profile and mamba_ssm's layer after it: mamba_ssm's kernels autotune at
their first call, and two H100 calls limited to 170 and 240 s ended before it (BENCHMARKS.md, I2, I3); give
the whole script about 5 minutes (V10 took 292 s on an H200).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import bench_mamba3  # benchmarks/kernels (the script's directory is on sys.path)
import torch
import torch._dynamo
from timing import device_ms, fwd_bwd_step, kernel_ms, randomize_zero_weights

from megacpp.model.hybrid import Block
from megacpp.model.segments import document_segments
from megacpp.ops import mamba3_triton
from megacpp.presets import preset

SWAPPED = ("fused_fwd", "fused_bwd")


def load_variant(name: str, path: Path) -> ModuleType:
    """FILE as a module named after its variant (registered, as dataclasses in it need)."""
    spec = importlib.util.spec_from_file_location(f"mamba3_variant_{name}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--variant {name}={path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def use(functions: dict[str, object]) -> None:
    for attr, fn in functions.items():
        setattr(mamba3_triton, attr, fn)


def triton_kernel_ms(step, device: torch.device) -> dict[str, float]:
    """Device ms per step of megacpp's Triton kernels (names `_..._kernel`) over 5 profiled steps."""
    return {name: ms for name, ms in kernel_ms(step, device, calls=5).items()
            if name.startswith("_") and name.endswith("_kernel")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                   help="another mamba3_triton.py to time against this tree's (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--check", action="store_true", help="bench_mamba3's float64 check of this tree's kernels first")
    p.add_argument("--profile", action="store_true", help="each variant's Triton kernels, ms per step")
    args = p.parse_args()
    dev = torch.device("cuda")
    variants = {"this tree": {attr: getattr(mamba3_triton, attr) for attr in SWAPPED}}
    for spec in args.variant:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path).is_file():
            raise SystemExit(f"--variant expects NAME=FILE with an existing file, got {spec!r}")
        module = load_variant(name, Path(path))
        variants[name] = {attr: getattr(module, attr) for attr in SWAPPED}
    if args.check:
        check_args = argparse.Namespace(d_model=768, check_batch=2, check_seq=1000, doc_len=300)
        bench_mamba3.check(check_args, dev, bench_mamba3.SMALL)

    cfg = preset("small")
    b, t, d = 16, 2048, cfg.model.d_model
    x = torch.randn(b, t, d, device=dev, requires_grad=True)
    docs = document_segments((torch.arange(t, device=dev) // 512).expand(b, t).contiguous())
    torch.manual_seed(0)
    block = Block("M", cfg.model, 1).to(dev)
    randomize_zero_weights(block, std=0.02)
    step = fwd_bwd_step(torch.compile(block), x, docs)
    times: dict[str, list[float]] = defaultdict(list)
    for rnd in range(args.rounds):
        for name, functions in variants.items():
            use(functions)
            times[name].append(device_ms(step, dev, warmup=2, iters=args.iters))
            print(f"round {rnd} {name}: {times[name][-1]:.3f} ms", flush=True)
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | M sublayer, B{b} x T{t}, "
          "512-token documents, device ms", flush=True)
    for name, values in times.items():
        print(f"{name:<14} median {statistics.median(values):.3f}  rounds {' '.join(f'{v:.3f}' for v in values)}",
              flush=True)
    if args.profile:
        kernels = {}
        for name, functions in variants.items():
            use(functions)
            kernels[name] = triton_kernel_ms(step, dev)
        for kernel in sorted({k for per in kernels.values() for k in per}):
            print(f"  {kernel:<24}" + "".join(f"  {name} {per.get(kernel, 0.0):.3f}" for name, per in kernels.items()),
                  flush=True)
    use(variants["this tree"])

    try:
        from mamba_ssm.modules.mamba3 import Mamba3 as PeerMamba3

        from megacpp.model.mamba3_convert import config_to_mamba_ssm
    except ImportError as exc:
        print(f"mamba_ssm anchor unavailable ({exc}): put its source at .peers/mamba_src", flush=True)
        return
    torch.manual_seed(0)
    peer = PeerMamba3(**config_to_mamba_ssm(d, cfg.model.mamba), device=dev)
    anchor = statistics.median(device_ms(fwd_bwd_step(peer, x), dev, warmup=2, iters=args.iters) for _ in range(2))
    print(f"{'mamba_ssm':<14} median {anchor:.3f} (Mamba3 SISO, eager, no document resets)")
    for name, values in times.items():
        print(f"{name:<14} {statistics.median(values) / anchor:.3f}x mamba_ssm's layer")


if __name__ == "__main__":
    main()
