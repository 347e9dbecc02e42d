"""Under torchrun (gloo, CPU): replicate data parallelism against one device.

1. The sharded optimizer step: every rank builds the same `tiny`-shaped model from one seed, routes it
   (Muon and AdamW groups, a split-QKV matrix, stacked experts, QK-clip on) and holds two stacks: a
   single-device one over every parameter of a full copy, and replicate's, which steps the parameters
   this rank owns and all-gathers the owners' updates. Given the same (already reduced) gradients for
   4 steps, every parameter of every replica and every moment an owner holds must equal the
   single-device values bitwise; the blocks' updates land as a forward reaches them (its logits equal the
   single device's) or when the state_dict is read.
2. The gradient reduction: each rank backpropagates its own batch (3 micro-batches, the last one armed),
   for two steps; after `finish` every gradient must equal the mean of the ranks' local gradients,
   exactly on 2 ranks (a sum of two fp32 numbers is the same in any order; halving is exact), and each
   bucket's gradients must be aligned views of one buffer.

Prints PASS per rank. Usage: torchrun --nproc-per-node=N tests/distributed/replicate_parity.py
[--adamw-momentum-dtype bfloat16] (AdamW's first moments stored in bf16 by both stacks; Muon's momentum is
bf16 in the tiny preset already)
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

from megacpp.distributed.context import DistContext
from megacpp.distributed.replicate import optimizer_work, replicate
from megacpp.model.hints import collect_param_hints
from megacpp.model.hybrid import HybridLM
from megacpp.optim import build_optimizers
from megacpp.optim.stack import read_after_step
from megacpp.presets import preset
from tests.distributed.teardown import close_group


def tiny_model() -> HybridLM:
    cfg = preset("tiny").model
    cfg.vocab_size, cfg.d_model, cfg.depth = 97, 32, 5
    cfg.attention.n_heads, cfg.attention.n_kv_heads, cfg.attention.head_dim = 2, 1, 16
    cfg.attention.qk_clip, cfg.attention.qk_norm, cfg.attention.qk_clip_tau = "weight", False, 0.5
    cfg.mamba.d_state, cfg.mamba.head_dim, cfg.mamba.chunk_size = 8, 16, 16
    cfg.moe.n_experts, cfg.moe.expert_hidden = 4, 32
    cfg.rnn.n_heads, cfg.rnn.key_dim, cfg.rnn.value_dim = 2, 8, 8
    cfg.ffn.hidden, cfg.engram.layers, cfg.engram.dim, cfg.engram.ngram_table_size = 64, [1], 8, 257
    torch.manual_seed(3)
    return HybridLM(cfg)


def check_optimizer_step(ctx: DistContext, adamw_momentum_dtype: str) -> None:
    optim = preset("tiny").optim
    optim.adamw_momentum_dtype = adamw_momentum_dtype
    model = tiny_model()
    reference = copy.deepcopy(model)
    whole = read_after_step(model)
    replication = replicate(model, ctx, lambda p: optimizer_work(p.shape, p.ndim >= 2),
                            whole_after_step=lambda p: p in whole)
    stack = build_optimizers(model, optim, total_steps=10, log=None, hints=collect_param_hints(model),
                             model_compiled=False, owns=replication.owns, after_optimizers=replication.updates.gather)
    ref_stack = build_optimizers(reference, optim, total_steps=10, log=None, model_compiled=False)
    mine, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    assert 0 < len(stack.parameters()) < len(mine), "each rank steps some parameters, none steps all"
    gen = torch.Generator().manual_seed(11)
    for step in range(4):
        for name, p in mine.items():
            g = torch.randn(p.shape, generator=gen) * (1 + step)
            p.grad, theirs[name].grad = g.clone(), g
        for attention in (m for m in model.modules() if hasattr(m, "logit_bound")):  # the forward's bound
            attention.logit_bound.fill_(7.0 + step)
        for attention in (m for m in reference.modules() if hasattr(m, "logit_bound")):
            attention.logit_bound.fill_(7.0 + step)
        stack.step()
        ref_stack.step()
        land_deferred_weights(replication, model, reference, step)
        for name, p in mine.items():
            assert torch.equal(p.detach(), theirs[name].detach()), f"step {step}: parameter {name}"
        reference_moments = ref_stack.moments()
        owned_moments = stack.moments()
        assert owned_moments, "this rank owns moments"
        for key, value in owned_moments.items():
            assert torch.equal(value, reference_moments[key]), f"step {step}: moment {key}"
        assert stack.metrics["grad_norm"] == ref_stack.metrics["grad_norm"], "the clip norm covers every gradient"
        stack.zero_grad()
        ref_stack.zero_grad()
        assert all(p.grad is None for p in mine.values()), "every gradient cleared, not only the owned ones"
    every = ctx.all_gather_objects(sorted(stack.moments()))
    keys = [key for rank_keys in every for key in rank_keys]
    assert len(keys) == len(set(keys)) == len(ref_stack.moments()), "each moment is held by exactly one rank"
    replication.gradients.close()


def land_deferred_weights(replication, model: torch.nn.Module, reference: torch.nn.Module, step: int) -> None:
    """After the step the blocks' all-gathers are still pending (the parameters MuonClip read were whole). On
    even steps a forward lands them block run by block run, and its logits equal the reference's bitwise;
    on odd steps the model's state_dict lands them all at once."""
    updates = replication.updates
    assert updates.pending == len(updates.groups) - 1 >= 2, f"step {step}: the block runs wait for the forward"
    if step % 2 == 0:
        idx = torch.arange(24).view(2, 12) % 97
        with torch.no_grad():
            assert torch.equal(model(idx), reference(idx)), f"step {step}: logits"
    else:
        model.state_dict()
    assert updates.pending == 0, f"step {step}: landed"


def check_gradient_reduction(ctx: DistContext) -> None:
    model = tiny_model()
    replication = replicate(model, ctx, lambda p: optimizer_work(p.shape, p.ndim >= 2))
    gen = torch.Generator().manual_seed(100 + ctx.rank)  # each rank its own batch
    micro_batches = 3
    for step in range(2):  # the second step starts from cleared gradients, as after an optimizer step
        for index in range(micro_batches):
            idx = torch.randint(0, 97, (2, 24), generator=gen)
            if index == micro_batches - 1:
                replication.gradients.arm()
            loss = model(idx[:, :-1], idx[:, 1:]) / micro_batches
            loss.backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}  # before the mean
        replication.gradients.finish()
        check_mean(ctx, model, local, step)
        check_views(replication)
        model.zero_grad(set_to_none=True)
    replication.gradients.close()


def check_mean(ctx: DistContext, model: torch.nn.Module, local: dict[str, torch.Tensor], step: int) -> None:
    gathered = ctx.all_gather_objects(local)
    for name, p in model.named_parameters():
        if p.grad is None:
            assert all(name not in rank_grads for rank_grads in gathered), name
            continue
        total = gathered[0][name].clone()
        for rank_grads in gathered[1:]:
            total += rank_grads[name]
        expected = total * (1.0 / ctx.world_size)
        if ctx.world_size == 2:
            assert torch.equal(p.grad, expected), f"step {step}: gradient {name}"
        else:  # a ring's sum of three may round in another order: within a few ulps of the mean
            assert (p.grad - expected).abs().max() <= 4 * torch.finfo(torch.float32).eps * total.abs().max(), name


def check_views(replication) -> None:
    """Each bucket's reduced gradients are views of one buffer, each starting 64-byte aligned, shaped and
    strided as its parameter."""
    for bucket in replication.gradients.buckets:
        grads = [p.grad for p in bucket if p.grad is not None]
        assert len({g.untyped_storage().data_ptr() for g in grads}) <= 1, "one buffer per bucket"
        for p in bucket:
            if p.grad is not None:
                assert p.grad.data_ptr() % 64 == 0, "aligned"
                assert p.grad.shape == p.shape and p.grad.stride() == p.stride()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adamw-momentum-dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    ctx = DistContext(dist.get_rank(), dist.get_world_size(), dist.get_rank(), torch.device("cpu"))
    check_optimizer_step(ctx, args.adamw_momentum_dtype)
    check_gradient_reduction(ctx)
    print(f"rank {ctx.rank} PASS")
    close_group()


if __name__ == "__main__":
    main()
