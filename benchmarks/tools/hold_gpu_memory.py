"""Make bigger cards look like 80 GB H100s for a memory-fit run: hold each given GPU's memory beyond an
H100's in this process, then sleep until killed. A trainer started after the line ``held`` then sees about
the free memory an H100 80GB HBM3 gives a process (81,559 MiB in all, less the CUDA context), and less by
this process's own context (~0.5 GiB), so a run that fits beside it fits an H100.

    python benchmarks/tools/hold_gpu_memory.py 0,1 & HOLD=$!   # wait for "held" on its output
    torchrun --standalone --nproc-per-node=2 -m megacpp.cli train --preset nam52 --train.recompute all
    kill $HOLD

Why not ``torch.cuda.set_per_process_memory_fraction`` in the trainer: it caps PyTorch's allocator only,
not NCCL's buffers or other libraries' allocations, and it has to be set inside every training process.
"""
from __future__ import annotations

import argparse
import time

H100_80GB_BYTES = 81_559 * 2**20  # memory.total of an "NVIDIA H100 80GB HBM3" as nvidia-smi reports it


def bytes_to_hold(total_bytes: int, target_bytes: int = H100_80GB_BYTES) -> int:
    """How much of a card of `total_bytes` to hold so that `target_bytes` remain (none on a smaller card)."""
    if total_bytes < 0 or target_bytes < 0:
        raise ValueError(f"sizes must be >= 0, got total {total_bytes} and target {target_bytes}")
    return max(total_bytes - target_bytes, 0)


def parse_gpus(text: str) -> list[int]:
    """'0,1' -> [0, 1]; a clear error for anything else."""
    try:
        gpus = [int(part) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"GPUs {text!r}: expected comma-separated CUDA device indices, e.g. 0,1") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise SystemExit(f"GPUs {text!r}: expected distinct non-negative indices")
    return gpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gpus", type=parse_gpus, help="comma-separated CUDA device indices, e.g. 0,1")
    parser.add_argument("--target-mib", type=int, default=H100_80GB_BYTES // 2**20,
                        help="the card size to leave, in MiB (default: an H100 80GB's 81,559)")
    args = parser.parse_args()
    if args.target_mib <= 0:
        parser.error(f"--target-mib must be a positive size in MiB, got {args.target_mib}")

    import torch

    held = []
    for index in args.gpus:
        total = torch.cuda.mem_get_info(index)[1]
        extra = bytes_to_hold(total, args.target_mib * 2**20)
        try:
            held.append(torch.empty(extra, dtype=torch.uint8, device=f"cuda:{index}"))
        except torch.OutOfMemoryError:
            raise SystemExit(f"GPU {index}: cannot hold {extra / 2**30:.1f} GiB (is another job on it?)") from None
        free = torch.cuda.mem_get_info(index)[0]
        print(f"GPU {index}: {total / 2**30:.1f} GiB, held {extra / 2**30:.1f} GiB, free now {free / 2**30:.1f} GiB",
              flush=True)
    print("held", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
