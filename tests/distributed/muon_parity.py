"""Under torchrun: ShardedMuon on dim-0 DTensor shards vs single-device Muon on the whole tensors.

Every rank builds the same parameters and gradients from one seed, steps a single-device Muon on full
copies and a ShardedMuon on DTensor shards, and requires the gathered parameters and optimizer
states to be bitwise equal after each step. Shapes cover tall, wide and square matrices, a split-QKV
matrix, row counts that do not divide by the world size, fewer matrices of a shape than ranks,
fewer rows than ranks, and stacked (E, A, B) parameters with E not divisible by the world size.
With ``--replicas R`` the parameters live on a 2-D (replicas, shards) mesh of shape (R, W / R) with
placements (Replicate(), Shard(0)), as under hsdp: each replica's shard group exchanges rows on its own.

On a GPU (``--device cuda``, NCCL) cuBLAS may pick other kernels for the owner's smaller batches, so
the comparison reports the largest difference relative to the parameters' scale and checks it against
``--tolerance`` instead of requiring equality.

``--momentum-dtype bfloat16`` stores the momentum in bf16 on both sides: each rank rounds its own rows,
which are the single-device buffer's rows, so the comparison stays bitwise.

Usage: torchrun --nproc-per-node=N tests/distributed/muon_parity.py [--compile-backend aot_eager]
       [--device cuda --tolerance 1e-6] [--replicas R] [--momentum-dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from megacpp.distributed.muon import ShardedMuon
from megacpp.optim import Muon
from tests.distributed.teardown import close_group

SHAPES = {  # name -> (shape, group settings)
    "tall": ((48, 16), {}),
    "tall_odd": ((37, 11), {}),
    "wide": ((12, 40), {}),
    "square": ((24, 24), {}),
    "qkv": ((64, 32), {"split_sizes": (32, 16, 16)}),
    "few_rows": ((1, 9), {}),
    "experts": ((3, 10, 14), {"lr_scaling": "match_rms_adamw"}),
    "one_expert": ((1, 12, 8), {}),
}
COPIES = {"tall": 3, "wide": 2, "square": 1}  # same-shape buckets with more and fewer matrices than ranks


def build(make_param) -> list[dict]:
    gen = torch.Generator(device=torch.get_default_device()).manual_seed(7)
    groups = []
    for name, (shape, settings) in SHAPES.items():
        params = [make_param(torch.randn(shape, generator=gen)) for _ in range(COPIES.get(name, 1))]
        groups.append({"params": params, **settings})
    return groups


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-backend", default="")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tolerance", type=float, default=0.0)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--momentum-dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    if args.device == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        torch.set_default_device(f"cuda:{local}")
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    if args.replicas > 1:
        mesh = init_device_mesh(args.device, (args.replicas, dist.get_world_size() // args.replicas))
        placements = [Replicate(), Shard(0)]
    else:
        mesh = init_device_mesh(args.device, (dist.get_world_size(),))
        placements = [Shard(0)]
    worst = 0.0

    def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        nonlocal worst
        if args.tolerance == 0:
            assert torch.equal(a, b), what
            return
        err = ((a.double() - b.double()).abs().max() / a.double().abs().max().clamp_min(1e-30)).item()
        worst = max(worst, err)
        assert err <= args.tolerance, f"{what}: relative difference {err:.3e} > {args.tolerance}"
    kwargs = dict(lr=0.03, weight_decay=0.1, momentum=0.9, nesterov=True, variance_reduction=True,
                  cautious_weight_decay=True, momentum_dtype=args.momentum_dtype)
    if args.compile_backend:
        kwargs.update(compile_step=True, compile_backend=args.compile_backend)
    reference = Muon(build(lambda t: nn.Parameter(t.clone())), **kwargs)
    sharded = ShardedMuon(build(lambda t: nn.Parameter(distribute_tensor(t.clone(), mesh, placements))),
                          **kwargs)
    ref_params = [p for g in reference.param_groups for p in g["params"]]
    shard_params = [p for g in sharded.param_groups for p in g["params"]]
    from torch._dynamo.utils import counters

    gen = torch.Generator(device=torch.get_default_device()).manual_seed(11)
    graphs_after_first_step = None
    for step in range(4):
        for p, q in zip(ref_params, shard_params, strict=True):
            g = torch.randn(p.shape, generator=gen) * (1 + step)
            p.grad = g
            q.grad = distribute_tensor(g.clone(), mesh, placements)
        lr = 0.03 / (1 + step)  # the schedule moves lr: a compiled step must not recompile for it
        for opt in (reference, sharded):
            for group in opt.param_groups:
                group["lr"].fill_(lr)
            opt.step()
        for i, (p, q) in enumerate(zip(ref_params, shard_params, strict=True)):
            same(p.detach(), q.detach().full_tensor(), f"step {step}: parameter {i} {tuple(p.shape)}")
            for key, value in reference.state[p].items():
                same(value, sharded.state[q][key].full_tensor(), f"step {step}: {key} of parameter {i}")
        if step == 0:
            graphs_after_first_step = counters["stats"]["unique_graphs"]
    if args.compile_backend:
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0 and graphs == graphs_after_first_step, (graphs_after_first_step, graphs)
        print(f"rank {dist.get_rank()} compiled {graphs} graphs in the first step, none after")
    print(f"rank {dist.get_rank()} PASS (largest relative difference {worst:.3e})")
    del reference, sharded, ref_params, shard_params, p, q
    close_group()


if __name__ == "__main__":
    main()
