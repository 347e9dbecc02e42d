"""FSDP2 applied to a single-device model from the outside, after per-block compile (the ``fsdp`` and
``hsdp`` data-parallel strategies; megacpp.distributed.strategy chooses).

Order (torchtitan's): compile each block (megacpp.compile.compile_model, as on one device), then
`fully_shard` each block, then the root. FSDP2's hooks run outside the compiled regions, identical
blocks keep sharing one graph, and every parameter becomes a DTensor sharded on dim 0: each rank
holds ceil(n / S) rows, S the ranks of the shard dimension. Stacked (E, A, B) experts therefore shard by
whole matrices. On a 1-D mesh S is every rank (fsdp); on a 2-D (replicas, shards) mesh FSDP2 does HSDP:
placements (Replicate(), Shard(0)), gradients reduce-scattered within a shard group and all-reduced
across the replicas.

Decoding's prompt pass and step are the entry points besides ``forward`` that the trainer and the
decoder call on the model (the root's and each block's ``prefill`` and ``forward_step``); they are
registered with `register_fsdp_forward_method` so that they gather the weights they read too.
Everything else goes through ``forward`` (evaluation, NaN localisation by forward hooks).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from megacpp.compile.config import CompileConfig
from megacpp.compile.regions import CompiledModel, compile_model
from megacpp.distributed.config import DistConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Entry points besides forward. Only methods called from outside the module: a registered method
# called from inside another registered one would run FSDP's hooks twice.
ROOT_METHODS = ("forward_step", "prefill")
BLOCK_METHODS = ("forward_step", "prefill")


def fully_shard_model(model: nn.Module, compile_cfg: CompileConfig, dist_cfg: DistConfig, mesh: DeviceMesh,
                      ignored: set[nn.Parameter] | None = None) -> CompiledModel:
    """Compile `model` per `compile_cfg`, then shard it over ``mesh`` (1-D: shards; 2-D: replicas, shards),
    all but the ``ignored`` parameters (expert parallelism's expert rows, already split by expert)."""
    compiled = compile_model(model, compile_cfg)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if dist_cfg.param_dtype == "bfloat16" else None,
        reduce_dtype=torch.float32,  # gradients are averaged in fp32 whatever the compute dtype
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=dist_cfg.reshard_after_forward, mp_policy=policy,
                    ignored_params=ignored or None)
        for name in BLOCK_METHODS:
            register_fsdp_forward_method(block, name)
    if dist_cfg.prefetch > 0:
        prefetch_blocks(list(model.blocks), dist_cfg.prefetch)
    # The root's own parameters (embeddings, head, final norm) are used last in the forward and first
    # in the backward: keeping them gathered after forward saves one all-gather per step.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy, ignored_params=ignored or None)
    for name in ROOT_METHODS:
        register_fsdp_forward_method(model, name)
    return compiled


def prefetch_blocks(blocks: list[nn.Module], depth: int) -> None:
    """Each sharded block asks for the gathers of the `depth` blocks after it when its forward starts and of
    the `depth` blocks before it when its backward starts (in the order they will run), so those gathers
    are queued a block or more early even when the host does not run ahead of the GPU."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - depth):i][::-1])
