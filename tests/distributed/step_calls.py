"""Under torchrun: `ShardedMuon.first_step_calls` describes the compiled calls its first step makes.

Every rank builds muon_parity's parameters (tall, wide and square matrices, split QKV, uneven row counts,
fewer matrices than ranks, stacked experts) as dim-0 DTensor shards, asks for the first step's calls
(gradient stand-ins, meta tensors for the exchanged rows), then steps with gradients, recording each
call `_run` makes instead of compiling it, and requires the two descriptions to be equal: the same
functions in the same order, every tensor's shape, strides, offset, dtype and aliasing, every constant.

Usage: torchrun --nproc-per-node=N tests/distributed/step_calls.py
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from megacpp.distributed.muon import ShardedMuon
from megacpp.optim.hparams import StepCall, TensorHParamOptimizer
from megacpp.train.step_prewarm import describe, map_tensors
from tests.distributed.muon_parity import build
from tests.distributed.teardown import close_group


def on_cpu(spec):
    """A description with stand-ins' device (None: the call's) read as the CPU."""
    return map_tensors(spec, lambda leaf: dataclasses.replace(leaf, device=leaf.device or "cpu"))


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    opt = ShardedMuon(build(lambda t: nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]))), lr=0.03,
                      weight_decay=0.1, variance_reduction=True, cautious_weight_decay=True, compile_step=True)
    promised = [StepCall(c.fn, on_cpu(describe(c.args)), c.backend) for c in opt.first_step_calls()]
    made: list[StepCall] = []

    def record(self, fn, *args):  # the step's own calls, described, then run eagerly
        made.append(StepCall(fn, describe(args), self.compile_backend))
        return fn(*args)

    TensorHParamOptimizer._run = record
    gen = torch.Generator().manual_seed(3)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), mesh, [Shard(0)])
    opt.step()
    names = [c.fn.__name__ for c in made]
    assert len(made) == len(promised), (names, [c.fn.__name__ for c in promised])
    for i, (want, got) in enumerate(zip(promised, made, strict=True)):
        assert want == got, f"call {i} ({got.fn.__name__}): promised {want.args}\nmade {got.args}"
    assert {"muon_step_part1", "momentum_update", "orthogonal_update", "apply_update"} <= set(names), names
    print(f"rank {dist.get_rank()} PASS ({len(made)} calls)")
    del opt
    close_group()


if __name__ == "__main__":
    main()
