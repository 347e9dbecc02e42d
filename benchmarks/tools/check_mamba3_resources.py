"""Compile the fused Mamba-3 Triton kernels for a GPU architecture, without a GPU, and check that each
fits one streaming multiprocessor: shared memory, registers, spills.

    python benchmarks/tools/check_mamba3_resources.py                      # sm_90 (H100/H200): tiny, small, nam52
    python benchmarks/tools/check_mamba3_resources.py --presets small --modes fp32
    python benchmarks/tools/check_mamba3_resources.py --arch 80            # A100
    python benchmarks/tools/check_mamba3_resources.py --device             # on a GPU machine: its own architecture

For every preset's M-mixer sizes (B --batch x T --seq) and operand mode it runs `fused_fwd` and
`fused_bwd` (megacpp/ops/mamba3_triton.py) on meta tensors laid out as the mixer hands them over (x and
z strided views of the in_proj output), with a `launch` that records each kernel launch instead of
running it. Each launch's arguments are then specialized as Triton's launcher does (tensors as typed
pointers, 16-byte aligned where their offset is; tensor descriptors by dtype and tile; integers as
i32/i64, marked divisible by 16 where they are; integers equal to 1 as constants), compiled for the
target by the installed Triton, and measured: shared memory from the compiled kernel's metadata,
registers per thread and spill bytes from `ptxas -v` as Triton's own backend runs it (same ptxas, same
flags) on the kernel's PTX.

Shared memory and registers x threads are hard limits: past them a launch fails. Spills only cost time,
so they are held to what each tiling was timed with (`tilings()` in megacpp/ops/mamba3_triton.py):
--max-spill bytes (default 0) for most kernels, `TIMED_SPILLS` for the one whose fastest tiling spills.
Spills are reported but not counted for a kernel launched with a register cap (`Tiling.max_registers`:
the cap trades them for more programs per SM, and was timed that way) and for the fp32-operand tilings,
which were never timed: no preset runs them (the presets that take the Triton scan use 16-bit operands,
and with fp32 operands the reference scan is faster, BENCHMARKS.md N3).

Modes: "fp32" (fp32 activations, fp32 matmul operands: "tf32x3", or "tf32" with --tf32), "bf16"
(bf16 x/z under autocast, fp32 matmul operands: scan_matmuls "fp32"), "bf16-mm" (bf16 x/z and bf16
matmul operands: scan_matmuls "activation").

Exit status 1 when a kernel is over budget: shared memory above --max-shared bytes (default 200 KiB;
sm_90 allows 227 KiB per block, and Triton versions allocate a little differently, so keep a margin),
spill stores above the kernel's spill budget, registers x threads above 65536, or a failed compile.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import time
from dataclasses import dataclass

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from megacpp.model.mamba3 import Mamba3
from megacpp.ops import mamba3_triton
from megacpp.ops.kernel_prewarm import Launch
from megacpp.presets import PRESETS

REGISTER_FILE = 65536  # 32-bit registers per SM (sm_70 to sm_120)
# (activation dtype, matmul operand dtype) per mode.
MODES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.float32),
         "bf16-mm": (torch.bfloat16, torch.bfloat16)}
_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
                 torch.int32: "i32"}
KERNELS = ("fwd_states", "fwd_scan", "gate_bwd", "bwd_states", "bwd_chunk", "bwd_bc")
# Spill stores (bytes) a timed, uncapped tiling is allowed where its fastest tiling spills. The dB/dC kernel at
# 4 warps and two stages (16-bit operands): 1.01 ms alone at `small` on an H100 against 1.63 at 8 warps,
# which do not spill (BENCHMARKS X3); it spills 200 B under Triton 3.6 (N3's call) and 172 under 3.9.
TIMED_SPILLS = {"bwd_bc": 256}


@dataclass(frozen=True)
class Usage:
    shared: int  # bytes per block
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int
    threads: int


def mixer_launches(preset: str, batch: int, seq: int, act: torch.dtype, matmul: torch.dtype) -> list[Launch]:
    """Every kernel launch of one M mixer's forward and backward at the preset's sizes, recorded
    from `fused_fwd`/`fused_bwd` on meta tensors (training: no initial state, no final-state gradient)."""
    cfg = PRESETS[preset]().model
    with torch.device("meta"):
        mixer = Mamba3(cfg.d_model, cfg.mamba, layer_idx=0)
    h, p, g, n, na = mixer.n_heads, cfg.mamba.head_dim, cfg.mamba.n_groups, cfg.mamba.d_state, mixer.n_angles
    meta = torch.device("meta")
    proj = torch.empty(batch, seq, sum(mixer.split_sizes), dtype=act, device=meta)
    z, x = (v.view(batch, seq, h, p) for v in proj.split(mixer.split_sizes, dim=-1)[:2])
    f32 = dict(dtype=torch.float32, device=meta)
    B, C = torch.empty(batch, seq, g, n, **f32), torch.empty(batch, seq, g, n, **f32)  # after their RMSNorm
    bias, theta = torch.empty(h, n, **f32), torch.empty(batch, seq, h, na, **f32)
    per_token = torch.empty(batch, seq, h, **f32)  # log-decay, sigma, gamma
    D = torch.empty(h, **f32)
    recorded: list[Launch] = []
    chunk = cfg.mamba.chunk_size
    y, _, states, y_pre = mamba3_triton.fused_fwd(x, z, B, C, bias, bias, theta, per_token, per_token, per_token, D,
                                                  None, chunk, matmul, launch=recorded.append)
    mamba3_triton.fused_bwd(x, z, B, C, bias, bias, theta, per_token, per_token, per_token, D, states, y_pre,
                            torch.empty_like(y), None, chunk, matmul, launch=recorded.append)
    return recorded


def specialize(launch: Launch) -> tuple[dict, dict, dict]:
    """Signature, constexprs and attributes of the launch, by the rules of Triton's launcher."""
    names = launch.kernel.arg_names
    constexprs = {k: v for k, v in launch.meta.items() if k in names}
    signature, attrs = {}, {}
    positional = [name for name in names if name not in constexprs]
    for name, value in zip(positional, launch.args, strict=True):
        index = names.index(name)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
            aligned = value.storage_offset() * value.element_size() % 16 == 0  # allocations are aligned
        elif isinstance(value, TensorDescriptor):
            signature[name], aligned = mangle_type(value), False  # tensordesc<dtype[tile]>
        elif isinstance(value, bool):
            signature[name], aligned = "i1", False
        elif isinstance(value, int):
            if value == 1:
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            aligned = value % 16 == 0
        else:
            raise TypeError(f"{launch.kernel.__name__}: argument {name} of type {type(value).__name__}")
        if aligned:
            attrs[(index,)] = [["tt.divisibility", 16]]
    for name in constexprs:
        signature[name] = "constexpr"
    return {name: signature[name] for name in names}, constexprs, attrs


def _ptxas_report(kernel, target: GPUTarget, options: dict) -> str:
    """ptxas -v output for the compiled kernel's PTX, from Triton's backend (its ptxas and flags)."""
    backend = CUDABackend(target)
    opt = backend.parse_options(options)
    out = io.StringIO()
    with knobs.nvidia.scope():
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(out):
            backend.make_cubin(kernel.asm["ptx"], {}, opt, target.arch)
    return out.getvalue()


def measure(launch: Launch, target: GPUTarget) -> Usage:
    signature, constexprs, attrs = specialize(launch)
    options = {k: v for k, v in launch.meta.items() if k in ("num_warps", "num_stages", "maxnreg")}
    kernel = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target, options=options)
    log = _ptxas_report(kernel, target, options)
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"no register/spill line in the ptxas output: {log[-500:]!r}")
    return Usage(kernel.metadata.shared, int(regs.group(1)), int(spills.group(1)), int(spills.group(2)),
                 options["num_warps"] * 32)


def spill_budget(kernel: str, matmul: torch.dtype, capped: bool, max_spill: int) -> int | None:
    """Spill stores allowed for this kernel's tiling, or None where spills are not counted: under a
    register cap (spilling by choice, timed so) and for the untimed fp32-operand tilings (module doc)."""
    if capped or matmul == torch.float32:
        return None
    return max(max_spill, TIMED_SPILLS.get(kernel, 0))


def problems(usage: Usage, max_shared: int, max_spill: int | None) -> list[str]:
    """What is over budget; max_spill None: spills are not counted."""
    found = []
    if usage.shared > max_shared:
        found.append(f"shared {usage.shared} > {max_shared}")
    if max_spill is not None and usage.spill_stores > max_spill:
        found.append(f"spills {usage.spill_stores} B > {max_spill}")
    if usage.registers * usage.threads > REGISTER_FILE:
        found.append(f"{usage.registers} registers x {usage.threads} threads > {REGISTER_FILE}")
    return found


def check(presets: list[str], modes: list[str], target: GPUTarget, batch: int, seq: int, max_shared: int,
          max_spill: int, out=sys.stdout) -> int:
    """Print one row per kernel, preset and mode; returns how many are over budget or failed."""
    timed = ", ".join(f"{k} {v} B" for k, v in TIMED_SPILLS.items())
    print(f"triton {triton.__version__}, target {target.backend} sm_{target.arch}; budget: shared <= "
          f"{max_shared} B, spill stores <= {max_spill} B ({timed}; not counted under a register cap or with fp32 "
          f"operands), registers x threads <= {REGISTER_FILE}", file=out)
    print(f"{'preset':<7}{'mode':<9}{'kernel':<11}{'grid':>16}{'warps':>6}{'PB':>4}{'KB':>4}{'shared':>8}"
          f"{'regs':>6}{'spill st/ld':>13}  verdict", file=out)
    bad, seen = 0, {}
    for preset in presets:
        for mode in modes:
            act, matmul = MODES[mode]
            for name, launch in zip(KERNELS, mixer_launches(preset, batch, seq, act, matmul), strict=True):
                if target.arch < 80 and launch.meta.get("PREC") != "ieee":
                    launch = Launch(launch.kernel, launch.grid, launch.args, {**launch.meta, "PREC": "ieee"})
                cap = launch.meta.get("maxnreg")
                budget = spill_budget(name, matmul, cap is not None, max_spill)
                key = (name, repr(specialize(launch)), launch.meta.get("num_warps"), launch.meta.get("num_stages"), cap)
                started = time.perf_counter()
                try:
                    usage = seen[key] if key in seen else measure(launch, target)
                except Exception as exc:  # report and go on: one failing kernel must not hide the others
                    seen[key] = None
                    usage, why = None, [f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"]
                else:
                    seen[key] = usage
                    why = problems(usage, max_shared, budget)
                bad += bool(why)
                meta = launch.meta
                cols = (f"{preset:<7}{mode:<9}{name:<11}{str(launch.grid):>16}{meta['num_warps']:>6}"
                        f"{meta.get('PB', '-'):>4}{meta.get('KB', '-'):>4}")
                if usage is None:
                    print(f"{cols}  FAIL {why[0]}", file=out, flush=True)
                    continue
                verdict = "ok" if not why else "OVER: " + "; ".join(why)
                if cap is not None:
                    verdict += f" [capped at {cap} registers]"
                elif budget is None and usage.spill_stores:
                    verdict += " [fp32 operands: untimed tiling, spills not counted]"
                print(f"{cols}{usage.shared:>8}{usage.registers:>6}{usage.spill_stores:>7}/{usage.spill_loads:<5}"
                      f"  {verdict} ({time.perf_counter() - started:.0f} s)", file=out, flush=True)
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small", "nam52"], choices=sorted(PRESETS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--arch", type=int, default=90, help="compute capability as major*10+minor (90: H100/H200)")
    parser.add_argument("--device", action="store_true", help="the current CUDA device's architecture")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--max-shared", type=int, default=200 * 1024)
    parser.add_argument("--max-spill", type=int, default=0)
    parser.add_argument("--tf32", action="store_true", help="as with torch.backends.cuda.matmul.allow_tf32 = True")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    if args.device:
        major, minor = torch.cuda.get_device_capability()
        args.arch = major * 10 + minor
    bad = check(args.presets, args.modes, GPUTarget("cuda", args.arch, 32), args.batch, args.seq,
                args.max_shared, args.max_spill)
    print(f"{bad} kernel(s) over budget" if bad else "all kernels within budget")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
