"""Multi-GPU configuration: FSDP2 sharding, timeouts that separate a slow compile from a hang."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megacpp.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, ConfigSection, Interval


@dataclass
class DistConfig(ConfigSection):
    # How the ranks share the model (megacpp.distributed.strategy): "replicate" keeps the whole model on
    # every rank and reduces gradients once per optimizer step, with the optimizer step sharded by
    # parameter ownership; "fsdp" shards weights, gradients and optimizer state with FSDP2 (gathers
    # each block's weights in the forward and backward); "auto" replicates when the model, its
    # gradients and its share of the optimizer state fit the card with room for activations; "hsdp"
    # shards like fsdp within each group of `shard_size` consecutive ranks and replicates across the
    # groups (for several hosts: all-gathers stay on a host's links; auto never picks it).
    strategy: Literal["auto", "replicate", "fsdp", "hsdp"] = "auto"
    # hsdp: ranks per shard group; it must divide the number of ranks. 0: the ranks of one host
    # (torchrun's LOCAL_WORLD_SIZE). Equal to the number of ranks, hsdp is fsdp's layout.
    shard_size: int = 0
    # Ranks each E block's routed experts are split over (megacpp.distributed.expert_parallel): it must
    # divide the number of ranks and model.moe.n_experts; tokens travel to their experts' rank and back
    # by all-to-all (dropless). 1: every rank holds every expert. Runs with strategy replicate for the rest.
    expert_parallel: int = 1
    # fsdp: free each block's gathered weights after its forward and gather them again for the
    # backward. Off moves DDP's bytes (one reduce-scatter + one all-gather per step) and keeps the
    # whole model resident; on (nam52) trades a second all-gather for memory.
    reshard_after_forward: bool = False
    # fsdp/hsdp: blocks whose weights each block asks to gather ahead of their turn, in the forward (the
    # next ones) and the backward (the previous ones). 0 keeps FSDP2's own order: a block's gather is
    # issued when the host reaches it (early only while the host runs ahead of the GPU), the backward's
    # one block ahead.
    prefetch: int = 0
    # dtype of the all-gathered weights the blocks compute with. float32 keeps the fp32 router and
    # Mamba-3's fp32 per-head parameters exact; bfloat16 halves the all-gather bytes (opt-in).
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # Process-group timeout until warmup ends: ranks compile at different speeds (a cold compile of
    # `small` lags a warm one by a minute), so collectives must outwait the slowest compile.
    init_timeout_s: float = 7200.0
    # After warmup: the process-group timeout and the step watchdog. A step (or evaluation, or
    # checkpoint) that makes no progress for this long dumps every thread's stack and ends the job.
    step_timeout_s: float = 600.0
    # Steps between cross-rank checks of replicated state (buffers, loader, schedule); 0 = only at
    # checkpoints. Costs one small all-gather.
    fingerprint_every: int = 100
    # Resuming with another global batch (ranks x batch_size) reads a different token stream; refuse
    # unless this is set (the loader then continues from the same number of rows consumed).
    allow_global_batch_change: bool = False

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {"expert_parallel": AT_LEAST_1, "shard_size": NON_NEGATIVE,  # 0 = one host's ranks
                "prefetch": NON_NEGATIVE,  # 0 = FSDP2's own order
                "init_timeout_s": POSITIVE, "step_timeout_s": POSITIVE,
                "fingerprint_every": NON_NEGATIVE}  # 0 = only at checkpoints
