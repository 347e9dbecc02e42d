"""Under torchrun: the helper's graphs are the sharded step's. Each rank starts an optimizer helper on
`ShardedMuon.first_step_calls` (a tall and a wide row-sharded matrix, stacked experts), waits for it,
steps, and prints how many of the step's graphs came from the cache the helper filled.

Usage: torchrun --nproc-per-node=2 tests/distributed/step_prewarm_hits.py CACHE_DIR LOG_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from megacpp.compile.config import CompileConfig
from megacpp.compile.entry import prepare_compile
from megacpp.distributed.muon import ShardedMuon
from megacpp.train.step_prewarm import StepPrewarm, helper_jobs
from tests.distributed.teardown import close_group

SHAPES = [(48, 16), (12, 40), (3, 10, 14)]  # tall (per-row moments ride with the rows), wide, experts


def main() -> None:
    cfg = CompileConfig(cache_dir=sys.argv[1])
    prepare_compile(cfg)  # as the trainer: before the process group and the helpers
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(7)

    def shard(shape):
        return distribute_tensor(torch.randn(shape, generator=gen), mesh, [Shard(0)])

    opt = ShardedMuon([{"params": [nn.Parameter(shard(s)) for _ in range(2)]} for s in SHAPES], lr=0.03,
                      weight_decay=0.1, compile_step=True)
    calls = opt.first_step_calls()
    prewarm = StepPrewarm.start(helper_jobs({"muon": calls}, torch.device("cpu"), False, cfg), Path(sys.argv[2]),
                                f".rank{rank}")
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = shard(p.shape)
    print(f"rank {rank}: {prewarm.wait(timeout_s=600)}", flush=True)
    opt.step()
    print(f"rank {rank}: {prewarm.cache_line()} ({len(calls)} calls described)", flush=True)
    del opt
    close_group()


if __name__ == "__main__":
    main()
