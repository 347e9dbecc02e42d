"""Replicate data parallelism: ownership, the sharded optimizer step against one device, the gradient
reduction, and the strategy `auto` picks."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megacpp.distributed.context import DistContext
from megacpp.distributed.replicate import (
    GRADIENT_ALIGN,
    assign_owners,
    flatten_aligned,
    gather_groups,
    gradient_offsets,
    optimizer_work,
    replicate,
)
from megacpp.distributed.strategy import REPLICATE_COPIES, REPLICATE_SHARE, choose_strategy, newton_schulz_steps
from megacpp.optim import OptimConfig
from megacpp.optim.stack import read_after_step
from tests.test_optim_standins import TinyHybrid
from tests.torchrun import torchrun


def test_owners_balance_the_work_and_every_rank_computes_the_same_assignment():
    costs = [9.0, 7.0, 6.0, 5.0, 4.0, 4.0, 1.0]
    owners = assign_owners(costs, 3)
    assert owners == assign_owners(list(costs), 3)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(3)]
    # Longest first onto the least loaded: 9 -> 0, 7 -> 1, 6 -> 2, 5 -> 2, 4 -> 1, 4 -> 0, 1 -> 1.
    assert owners == [0, 1, 2, 2, 1, 0, 1] and loads == [13.0, 12.0, 11.0]
    assert assign_owners([1.0], 4) == [0]  # more ranks than parameters: the others own nothing
    # Continuing from earlier groups' load (updated in place): 3 -> 1 (0 < 5), then 1 -> 1 (3 < 5).
    load = [5.0, 0.0]
    assert assign_owners([3.0, 1.0], 2, load) == [1, 1] and load == [5.0, 4.0]


def test_optimizer_work_counts_orthogonalization_for_matrices_only():
    square = optimizer_work(torch.Size([64, 64]), orthogonalized=True, ns_steps=5)
    assert square.flops == 5 * 6 * 64 * 64 * 64 and square.bytes == 32 * 64 * 64
    stacked = optimizer_work(torch.Size([4, 16, 32]), orthogonalized=True, ns_steps=5)
    assert stacked.flops == 4 * 5 * 6 * 16 * 16 * 32  # four (16 x 32) matrices, the smaller side squared
    assert optimizer_work(torch.Size([64, 64]), orthogonalized=False).flops == 0
    assert optimizer_work(torch.Size([10]), orthogonalized=True).flops == 0


def test_the_balance_weighs_the_routed_experts_at_their_own_newton_schulz_iterations():
    """The routed experts' stacked weights (hinted routed_expert) at `expert_ns_steps`, every other matrix of the
    blocks at `ns_steps`, nothing outside the blocks; OptimConfig gives 0 for experts on AdamW."""
    model = TinyHybrid()
    names = {p: name for name, p in model.named_parameters()}
    steps = {names[p]: n for p, n in newton_schulz_steps(model, 5, 3).items()}
    experts = {"blocks.2.mixer.w_up", "blocks.2.mixer.w_down"}
    assert {name for name, n in steps.items() if n == 3} == experts
    assert steps.keys() == {name for name, p in model.named_parameters() if p.ndim >= 2 and name.startswith("blocks.")}
    assert set(newton_schulz_steps(model, 5).values()) == {5}
    assert OptimConfig().routed_expert_ns_steps == 5
    assert OptimConfig(expert_ns_steps=3).routed_expert_ns_steps == 3
    assert OptimConfig(expert_optimizer="adamw").routed_expert_ns_steps == 0


def test_tier1_a_bucket_holds_each_gradient_at_an_aligned_offset_with_zeros_between():
    """Each gradient's piece starts at a multiple of GRADIENT_ALIGN elements and holds its values; a missing
    gradient is zeros, and so is every gap."""
    params = [torch.empty(3, 5), torch.empty(16), torch.empty(7), torch.empty(2, 17)]
    offsets = gradient_offsets(params)
    assert offsets == [0, 16, 32, 48]  # 15, 16 and 7 elements, each rounded up to 16
    assert all(offset % GRADIENT_ALIGN == 0 for offset in offsets)
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    grads[2] = None
    flat = flatten_aligned(grads, params, offsets)
    assert flat.numel() == 48 + 34
    used = torch.zeros(flat.numel(), dtype=torch.bool)
    for grad, p, offset in zip(grads, params, offsets, strict=True):
        piece = flat[offset:offset + p.numel()].view_as(p)
        assert torch.equal(piece, grad if grad is not None else torch.zeros_like(p))
        used[offset:offset + p.numel()] = grad is not None
    assert torch.equal(flat[~used], torch.zeros(int((~used).sum())))


def test_tier1_the_owners_updates_are_gathered_whole_first_then_in_runs_of_consecutive_blocks():
    """Group 0 holds what lies outside the blocks and what MuonClip and the spectral cap read after the step;
    each later group one run of consecutive blocks (4 runs of 5 blocks: 1, 1, 1, 2), landed before the run's
    first block. Every parameter is in exactly one group."""
    from megacpp.model.hybrid import HybridLM
    from megacpp.presets import preset

    cfg = preset("tiny").model
    cfg.depth, cfg.attention.qk_clip, cfg.rnn.w_spectral_cap = 5, "weight", 1.0
    model = HybridLM(cfg)
    assert model.layout == "AEMFR"
    names = {p: name for name, p in model.named_parameters()}
    whole = read_after_step(model)
    assert sorted(names[p] for p in whole) == ["blocks.0.mixer.qkv.weight", "blocks.4.mixer.W"]
    params = list(model.parameters())
    groups = gather_groups(model, params, lambda p: p in whole)
    assert sorted(names[p] for members, _ in groups for p in members) == sorted(names.values())
    first, *runs = groups
    assert first[1] is None
    assert {names[p] for p in first[0]} == {n for n in names.values() if not n.startswith("blocks.")} | {
        "blocks.0.mixer.qkv.weight", "blocks.4.mixer.W"}
    assert [block for _, block in runs] == [model.blocks[0], model.blocks[1], model.blocks[2], model.blocks[3]]
    for (members, _), blocks in zip(runs, [(0,), (1,), (2,), (3, 4)], strict=True):
        assert {names[p].split(".")[1] for p in members} == {str(b) for b in blocks}
    # A model compiled whole cannot run the hooks' waits inside its graph: one group, landed after the step.
    ctx = DistContext(rank=0, world_size=2, device=torch.device("cpu"))
    updates = replicate(model, ctx, lambda p: optimizer_work(p.shape, True), land_in_forward=False).updates
    assert len(updates.groups) == 1 and updates.groups[0][1] is None
    assert sorted(names[p] for members in updates.groups[0][0].by_rank for p in members) == sorted(names.values())


def test_replicate_refuses_a_non_contiguous_parameter_naming_it():
    model = nn.Linear(4, 6, bias=False)
    model.weight = nn.Parameter(torch.empty(6, 4).t().contiguous().t())  # (6, 4) with transposed strides
    ctx = DistContext(rank=0, world_size=2, device=torch.device("cpu"))
    with pytest.raises(TypeError, match=r"contiguous parameters; weight has strides \(1, 6\)"):
        replicate(model, ctx, lambda p: optimizer_work(p.shape, True))


def _two_ranks_with(memory: int, monkeypatch) -> DistContext:
    monkeypatch.setattr("megacpp.distributed.strategy.device_memory", lambda _device: memory)
    return DistContext(rank=0, world_size=2, device=torch.device("cpu"))


def test_auto_replicates_what_fits_half_the_card_and_shards_what_does_not(monkeypatch):
    model = nn.Linear(1000, 1000, bias=False)  # 4 MB of fp32 weights
    weights = 4 * 1000 * 1000
    state = 8 * 1000 * 1000
    need = REPLICATE_COPIES * weights + state / 2
    fits = _two_ranks_with(int(need / REPLICATE_SHARE) + 1, monkeypatch)
    strategy, why = choose_strategy("auto", model, state, fits)
    assert strategy == "replicate" and why.startswith("auto: weights, gradients, buffers and 1/2")
    tight = _two_ranks_with(int(need / REPLICATE_SHARE) - 1, monkeypatch)
    strategy, why = choose_strategy("auto", model, state, tight)
    assert strategy == "fsdp" and "replicating would need" in why
    assert choose_strategy("fsdp", model, state, fits) == ("fsdp", "dist.strategy")
    assert choose_strategy("replicate", model, state, tight) == ("replicate", "dist.strategy")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_tier1_replicate_steps_equal_one_device_and_gradients_are_the_ranks_mean(nproc: int) -> None:
    """Bitwise on CPU: 4 optimizer steps (Muon incl. split QKV and stacked experts, AdamW, QK-clip, the
    clip norm) of the owners plus the all-gather equal a single-device stack on the same gradients, each
    moment is held by exactly one rank; after a 3-micro-batch accumulation the reduced gradients are the
    ranks' mean (exact on 2 ranks, within 4 ulps of the largest sum on 3)."""
    launch = torchrun(["tests/distributed/replicate_parity.py"], nproc=nproc, timeout=240).check()
    assert launch.output.count("PASS") == nproc


@pytest.mark.slow
def test_tier1_replicate_steps_with_bf16_first_moments_equal_one_device() -> None:
    """As above on 2 ranks with AdamW's first moments stored in bf16 too (optim.adamw_momentum_dtype; Muon's
    momentum is bf16 in both runs): the owners' bf16 moments and the gathered weights equal one device's."""
    launch = torchrun(["tests/distributed/replicate_parity.py", "--adamw-momentum-dtype", "bfloat16"], nproc=2,
                      timeout=240).check()
    assert launch.output.count("PASS") == 2
