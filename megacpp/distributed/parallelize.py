"""FSDP2 applied to a single-device model from the outside, after per-block compile (the ``fsdp``
data-parallel strategy; megacpp.distributed.strategy chooses).

Order (torchtitan's): compile each block (megacpp.compile.compile_model, as on one device), then
`fully_shard` each block, then the root. FSDP2's hooks run outside the compiled regions, identical
blocks keep sharing one graph, and every parameter becomes a DTensor sharded on dim 0: each rank
holds ceil(n / W) rows. Stacked (E, A, B) experts therefore shard by whole matrices.

The decoding step is the one entry point besides ``forward`` that the trainer and the decoder call
on the model (the root's and each block's ``forward_step``); it is registered with
`register_fsdp_forward_method` so it gathers the weights it reads too. Everything else goes through
``forward`` (evaluation, NaN localisation by forward hooks).
"""
from __future__ import annotations

import torch
from torch import nn

from megacpp.compile.config import CompileConfig
from megacpp.compile.regions import CompiledModel, compile_model
from megacpp.distributed.config import DistConfig
from megacpp.distributed.context import DistContext

# Entry points besides forward. Only methods called from outside the module: a registered method
# called from inside another registered one would run FSDP's hooks twice.
ROOT_METHODS = ("forward_step",)
BLOCK_METHODS = ("forward_step",)


def fully_shard_model(model: nn.Module, compile_cfg: CompileConfig, dist_cfg: DistConfig, ctx: DistContext,
                      ignored: set[nn.Parameter] | None = None) -> CompiledModel:
    """Compile `model` per `compile_cfg`, then shard it over `ctx`'s mesh, all but the ``ignored``
    parameters (expert parallelism's expert rows, already split by expert)."""
    compiled = compile_model(model, compile_cfg)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if dist_cfg.param_dtype == "bfloat16" else None,
        reduce_dtype=torch.float32,  # gradients are averaged in fp32 whatever the compute dtype
    )
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh, reshard_after_forward=dist_cfg.reshard_after_forward, mp_policy=policy,
                    ignored_params=ignored or None)
        for name in BLOCK_METHODS:
            register_fsdp_forward_method(block, name)
    # The root's own parameters (embeddings, head, final norm) are used last in the forward and first
    # in the backward: keeping them gathered after forward saves one all-gather per step.
    fully_shard(model, mesh=ctx.mesh, reshard_after_forward=False, mp_policy=policy, ignored_params=ignored or None)
    for name in ROOT_METHODS:
        register_fsdp_forward_method(model, name)
    return compiled
