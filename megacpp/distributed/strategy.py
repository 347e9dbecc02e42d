"""How the ranks share a model (``dist.strategy``), chosen once and applied from outside the model.

- ``replicate`` (megacpp.distributed.replicate): the whole model on every rank, gradients reduced once
  per optimizer step, the optimizer step sharded by parameter ownership. nanochat's layout: on two
  H200s it keeps 99.3% of one GPU's tokens/s per GPU, where FSDP2 kept 76% for `small`.
- ``fsdp`` (megacpp.distributed.parallelize): FSDP2 shards weights, gradients and optimizer state;
  each block's weights are gathered for its forward and backward. For models whose training state
  does not fit one card (`nam52`).
- ``hsdp``: the same FSDP2 over a 2-D (replicas, shards) mesh: each group of ``dist.shard_size``
  consecutive ranks (default: one host's) shards the model as fsdp does, and the groups replicate each
  other (gradients reduce-scattered within a group, then all-reduced across the groups). For several
  hosts: the per-block all-gathers stay on a host's links and only the gradient shards cross hosts.
- ``auto``: replicate when the weights, gradients, reduction buffers and this rank's share of the
  optimizer state take at most `REPLICATE_SHARE` of the card, leaving the rest to activations; else
  fsdp. Never hsdp: one host has nothing to replicate across, and auto cannot know the hosts' links.

The Trainer holds one `DataParallel` and calls its hooks at fixed points of a step; on one process
they do nothing, so the loop has no branch per strategy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from megacpp.compile.config import CompileConfig
from megacpp.compile.regions import CompiledModel, compile_model
from megacpp.distributed.config import DistConfig
from megacpp.distributed.context import DistContext, DistError, grid_mesh, local_world_size
from megacpp.distributed.expert_parallel import ExpertParallel, expert_blocks, shard_experts
from megacpp.distributed.muon import ShardedMuon
from megacpp.distributed.parallelize import fully_shard_model
from megacpp.distributed.parity import check_parity
from megacpp.distributed.replicate import OptimizerWork, Replication, optimizer_work, replicate
from megacpp.model.hints import canonical_name, collect_param_hints
from megacpp.optim.stack import read_after_step

# The share of a card replicate's resident state may take: the rest is for activations (on `small`
# at B16 x T2048 they peak near 20 GiB of an 80 GB card) and the allocator's fragmentation.
REPLICATE_SHARE = 0.5
# fp32 copies of the weights replicate keeps: the weights, their gradients, the gradient buckets in
# flight (at most one model's worth) and the all-gather of the owners' updates.
REPLICATE_COPIES = 4


@dataclass
class DataParallel:
    """One process: the model compiled as on any device, and hooks that do nothing."""
    compiled: CompiledModel
    name: str = "single process"
    why: str = ""
    optimizer_classes: dict[str, type] = field(default_factory=dict)
    experts: ExpertParallel | None = None

    def owns(self, p: Tensor) -> bool:
        """Whether this rank steps ``p``."""
        return True

    @property
    def grad_norm(self) -> Callable[[list[Tensor]], Tensor] | None:
        """The global gradient norm of a list of gradients, where the plain norm is not (None: it is)."""
        return None if self.experts is None else self.experts.global_norm

    @property
    def expert_params(self) -> dict[str, nn.Parameter]:
        """Parameters each rank holds other rows of (expert parallelism), by name."""
        return {} if self.experts is None else self.experts.params

    @property
    def shards_optimizer_by_owner(self) -> bool:
        return False

    def before_last_backward(self) -> None:
        """The step's last backward is next."""

    def after_backward(self) -> None:
        """Every backward of the step is done: gradients must be the global mean from here on."""
        if self.experts is not None:
            self.experts.finish_gradients()

    def after_optimizers(self) -> None:
        """The optimizers stepped: every rank must hold the new weights before anything reads them (replicate
        lands the blocks' as the next forward reaches each block: `settle` before any other reader)."""

    def settle(self) -> None:
        """Every rank holds the whole current weights when this returns (before an evaluation, a checkpoint, a
        sample, or handing the model back)."""

    def close(self) -> None:
        pass

    def describe(self) -> str:
        text = f"data parallelism: {self.name}" + (f" ({self.why})" if self.why else "")
        return text + (f"; {self.experts.describe()}" if self.experts is not None else "")


@dataclass
class FullyShardedParallel(DataParallel):
    """FSDP2 (fsdp, hsdp): gradients are reduce-scattered inside the backward; ShardedMuon steps the shards
    exactly."""


@dataclass
class ReplicatedParallel(DataParallel):
    replication: Replication | None = None

    def owns(self, p: Tensor) -> bool:
        return self.replication.owns(p) or (self.experts is not None and self.experts.holds(p))

    @property
    def shards_optimizer_by_owner(self) -> bool:
        return True

    def before_last_backward(self) -> None:
        self.replication.gradients.arm()

    def after_backward(self) -> None:
        self.replication.gradients.finish()
        super().after_backward()

    def after_optimizers(self) -> None:
        self.replication.updates.gather()

    def settle(self) -> None:
        self.replication.updates.complete()

    def close(self) -> None:
        self.replication.gradients.close()
        self.replication.updates.close()


def device_memory(device: torch.device) -> int | None:
    """Bytes of the memory a rank trains in: the GPU's, or on a CPU the host's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    from megacpp.runtime.model_size import host_memory_bytes

    return host_memory_bytes()


def choose_strategy(setting: str, model: nn.Module, state_bytes: int, ctx: DistContext) -> tuple[str, str]:
    """(strategy, why) for ``dist.strategy = setting``; ``state_bytes`` is the whole optimizer state."""
    if setting != "auto":
        return setting, "dist.strategy"
    weights = sum(4 * p.numel() for p in model.parameters())
    need = REPLICATE_COPIES * weights + state_bytes / ctx.world_size
    capacity = device_memory(ctx.device)
    gib = 2**30
    if capacity is not None and need <= REPLICATE_SHARE * capacity:
        return "replicate", (f"auto: weights, gradients, buffers and 1/{ctx.world_size} of the optimizer state "
                             f"take {need / gib:.1f} of {capacity / gib:.0f} GiB")
    if capacity is None:
        return "fsdp", "auto: this device's memory is unknown"
    return "fsdp", (f"auto: replicating would need {need / gib:.1f} GiB, over {REPLICATE_SHARE:.0%} of "
                    f"{capacity / gib:.0f} GiB")


def apply_data_parallel(model: nn.Module, compile_cfg: CompileConfig, dist_cfg: DistConfig, ctx: DistContext,
                        state_bytes: Callable[[], int], ns_steps: int = 5, expert_ns_steps: int | None = None
                        ) -> DataParallel:
    """Compile ``model`` per ``compile_cfg`` (as on one device), then apply the strategy over ``ctx``.
    ``state_bytes`` gives the whole optimizer state's size (asked only when ``auto`` must decide);
    ``ns_steps`` and ``expert_ns_steps`` (the routed experts' own, None: the same; 0: not orthogonalized) weigh
    the Newton-Schulz work in replicate's balance of the optimizer step over the ranks."""
    if not ctx.distributed:
        shard_experts(model, dist_cfg, ctx)  # refuses dist.expert_parallel > 1 on one process
        return DataParallel(compile_model(model, compile_cfg))
    # The layout's settings agree before any rank builds a group from them: a rank that disagreed would
    # wait in the mesh's setup for the whole init timeout. hsdp's shard size also as resolved (hosts
    # with other GPU counts differ there); the other strategies ignore it.
    blocks = [m.cfg.n_experts for _, m in expert_blocks(model)]
    shards = shard_group_size(dist_cfg) if dist_cfg.strategy == "hsdp" else None
    check_parity(ctx, {"strategy": dist_cfg.strategy, "shard_size": [dist_cfg.shard_size, shards],
                       "expert_parallel": [dist_cfg.expert_parallel, blocks]},
                 "before the data-parallel layout")
    if dist_cfg.strategy == "hsdp":
        check_hsdp(dist_cfg, ctx)
    # Before compile, so that the E blocks' graphs trace the exchange; before the choice, which sizes
    # what this rank holds.
    experts = shard_experts(model, dist_cfg, ctx)
    if experts is not None and dist_cfg.strategy == "auto":
        # The expert rows (most of an MoE model) are already split: what remains replicated is small
        # (`nam52` with EP 2: 55.0 GiB per GPU in all, BENCHMARKS.md).
        strategy, why = "replicate", "auto: the parameters besides the experts"
    else:
        strategy, why = choose_strategy(dist_cfg.strategy, model,
                                        state_bytes() if dist_cfg.strategy == "auto" else 0, ctx)
    local = set(experts.params.values()) if experts is not None else set()
    if strategy == "fsdp":
        return FullyShardedParallel(fully_shard_model(model, compile_cfg, dist_cfg, ctx.mesh, ignored=local), "fsdp",
                                    why, {"muon": ShardedMuon}, experts=experts)
    if strategy == "hsdp":
        mesh = grid_mesh(ctx, shards, ("replicas", "shards"))
        return FullyShardedParallel(fully_shard_model(model, compile_cfg, dist_cfg, mesh), "hsdp",
                                    f"{hsdp_layout(ctx.world_size, shards)}, {why}", {"muon": ShardedMuon})
    compiled = compile_model(model, compile_cfg)
    steps = newton_schulz_steps(model, ns_steps, expert_ns_steps)

    def work(p: nn.Parameter) -> OptimizerWork:
        iterations = steps.get(p, 0)
        return optimizer_work(p.shape, iterations > 0, iterations)

    whole = read_after_step(model)
    replication = replicate(model, ctx, work, local=lambda p: p in local, whole_after_step=lambda p: p in whole,
                            land_in_forward=compile_cfg.mode != "model")
    return ReplicatedParallel(compiled, "replicate", why, experts=experts, replication=replication)


def shard_group_size(cfg: DistConfig) -> int:
    """Ranks per hsdp shard group: ``dist.shard_size``, or for 0 the ranks torchrun started on this host."""
    return cfg.shard_size or local_world_size()


def hsdp_layout(world_size: int, shards: int) -> str:
    """The mesh in words, e.g. "2 replicas x 4 shards"."""
    replicas = world_size // shards
    text = f"{replicas} replica{'s' if replicas > 1 else ''} x {shards} shard{'s' if shards > 1 else ''}"
    return text + (": fsdp's layout" if replicas == 1 else "")


def check_hsdp(cfg: DistConfig, ctx: DistContext) -> None:
    """hsdp's settings, as one line naming the key: the shard groups tile the ranks; no expert parallelism."""
    shards = shard_group_size(cfg)
    if ctx.world_size % shards:
        source = "" if cfg.shard_size else f" (0: this host's {shards} rank(s), torchrun's LOCAL_WORLD_SIZE)"
        raise DistError(f"dist.shard_size = {cfg.shard_size}{source} does not divide the {ctx.world_size} rank(s) "
                        "of this job: hsdp's shard groups must tile the ranks (set dist.shard_size to a divisor)")
    if cfg.expert_parallel > 1:
        raise DistError(f"dist.strategy = hsdp with dist.expert_parallel = {cfg.expert_parallel}: expert parallelism "
                        "runs beside replicate or fsdp only (set dist.strategy to one of them)")


def newton_schulz_steps(model: nn.Module, ns_steps: int, expert_ns_steps: int | None = None
                        ) -> dict[nn.Parameter, int]:
    """The Newton-Schulz iterations of each parameter Muon steps by default (matrices of blocks; a routed
    expert's stacked weights, hinted routed_expert, at ``expert_ns_steps`` when given): an estimate for the
    balance only."""
    hints = collect_param_hints(model)
    steps = {}
    for name, p in model.named_parameters():
        if p.ndim >= 2 and name.startswith("blocks."):
            hint = hints.get(canonical_name(name))
            expert = expert_ns_steps is not None and hint is not None and hint.routed_expert
            steps[p] = expert_ns_steps if expert else ns_steps
    return steps
