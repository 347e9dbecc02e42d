"""Under torchrun (2 ranks): a compiled, FSDP2-sharded tiny hybrid warms up at batch 2, then both
ranks run batch 3 with recompiles forbidden (the batch axis is dynamic: nothing recompiles), then rank
1 alone changes the sequence length. Rank 1's recompile is refused with an error naming the guard;
rank 0, waiting in the next collective, ends when rank 1's process is gone: the job stops, no hang.
"""
from __future__ import annotations

import torch

from megacpp.compile.config import CompileConfig
from megacpp.compile.entry import prepare_compile
from megacpp.compile.health import forbid_recompiles
from megacpp.config import Config
from megacpp.distributed.config import DistConfig
from megacpp.distributed.context import init_distributed
from megacpp.distributed.parallelize import fully_shard_model
from megacpp.model.hybrid import HybridLM
from megacpp.presets import tiny


def step(model: HybridLM, batch: int, seq: int) -> None:
    x = torch.randint(0, model.cfg.vocab_size, (batch, seq))
    model(x, x, torch.zeros_like(x)).backward()


def main() -> None:
    compile_cfg = CompileConfig(mode="blocks", backend="aot_eager")
    prepare_compile(compile_cfg)
    ctx = init_distributed("cpu", DistConfig())
    cfg: Config = tiny()
    cfg.model.d_model, cfg.model.vocab_size, cfg.model.engram.layers = 32, 64, []
    cfg.model.attention.n_heads, cfg.model.attention.n_kv_heads, cfg.model.attention.head_dim = 2, 1, 16
    cfg.model.mamba.head_dim, cfg.model.mamba.d_state, cfg.model.mamba.chunk_size = 16, 8, 8
    cfg.model.rnn.n_heads, cfg.model.rnn.key_dim, cfg.model.rnn.value_dim = 2, 8, 8
    cfg.model.moe.expert_hidden, cfg.model.ffn.hidden, cfg.model.depth = 16, 32, 5
    torch.manual_seed(0)
    model = HybridLM(cfg.model)
    compiled = fully_shard_model(model, compile_cfg, DistConfig(), ctx.mesh)
    step(model, 2, 16)
    compiled.end_warmup()
    with forbid_recompiles():
        step(model, 3, 16)
        ctx.barrier()
        if ctx.is_main:
            print("both ranks: batch 2 -> 3 without a recompile", flush=True)
        try:
            step(model, 3, 24 if ctx.rank == 1 else 16)
        except Exception as exc:
            print(f"rank {ctx.rank}: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
            raise
    ctx.close(orderly=True)


if __name__ == "__main__":
    main()
