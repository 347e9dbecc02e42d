"""Named presets. Each is a documented, complete configuration; README's table lists them.

- ``tiny``: CPU default. Every block kind (A, E, M, F, R) plus an Engram branch and the n-gram hash
  embedding, 128 wide, trains in minutes on 2 cores; eager (compiling does not pay on a 2-core CPU).
- ``small``: one GPU. ``AEMEAEMEAEMR`` at width 768 over 24 sublayers: active compute per token close
  to nanochat's d12 (12 attention + 12 MLP sublayers at width 768); its M, R and E blocks train at
  half the learning rate, and its Mamba-3 scan multiplies bf16 operands under autocast, in the fused
  Triton kernels on CUDA.
- ``dense``: the baseline every hybrid is held against. ``small``'s whole stack (width, attention,
  FFN, vocabulary, sequence length, optimizer, schedule) with the pattern ``AF`` and base learning
  rates: 12 attention + 12 dense MLP sublayers at width 768, about nanochat's d12.
- ``nam52``: a node of 8 GPUs. 52 sublayers of ``AEMEAEMEAEMR`` (13 A, 13 M, 22 E, 4 R) at width 2048.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

from megacpp.errors import ConfigError

if TYPE_CHECKING:
    from megacpp.config import Config


def _defaults() -> Config:
    """The built-in defaults every preset starts from."""
    # Imported here, not at the top: the preset names (`megacpp --help`'s choices) then load without
    # megacpp.config and every section it composes (~40 ms that --help never reads).
    from megacpp.config import Config

    return Config()


def tiny() -> Config:
    cfg = _defaults()
    m = cfg.model
    m.d_model, m.depth, m.pattern = 128, 10, "AEMFR"
    m.attention.n_heads, m.attention.n_kv_heads, m.attention.head_dim = 4, 2, 32
    m.mamba.d_state, m.mamba.expand, m.mamba.head_dim = 16, 2, 32
    m.moe.n_experts, m.moe.top_k, m.moe.expert_hidden = 8, 2, 128
    m.rnn.n_heads, m.rnn.key_dim, m.rnn.value_dim = 4, 32, 32
    m.ffn.hidden = 512
    m.engram.layers = [3]
    m.engram.ngram_hash = True
    cfg.data.seq_len = 256
    cfg.train.batch_size = 16
    cfg.train.steps, cfg.train.eval_every, cfg.train.ckpt_every = 200, 50, 100
    cfg.train.out_dir = "runs/tiny"
    # On a 2-core CPU a cold Inductor compile costs ~45 s and buys ~5% step time (BENCHMARKS.md).
    cfg.compile.mode = "none"
    return cfg


def small() -> Config:
    cfg = _defaults()
    m = cfg.model
    m.d_model, m.depth, m.pattern = 768, 24, "AEMEAEMEAEMR"
    m.attention.n_heads, m.attention.n_kv_heads, m.attention.head_dim = 6, 2, 128
    m.mamba.d_state, m.mamba.expand, m.mamba.head_dim = 128, 2, 64
    # bf16 operands under autocast (as mamba_ssm's kernels): with the reference scan the M mixer took 10.5 ms
    # instead of 13.4 on an H200 (docs/benchmarks_archive.md)
    m.mamba.scan_matmuls = "activation"
    # The fused Triton scan on CUDA (the reference on CPU): at these sizes on an H200 the compiled M
    # sublayer takes 6.47 ms with it and 10.12 with the reference scan (BENCHMARKS.md, sublayers).
    m.mamba.scan_kernel = "auto"
    # The fused loss head on CUDA (the reference on CPU): the compiled head 11.2 -> 10.0 ms per step on an
    # H200 at the same peak memory (docs/benchmarks_archive.md, 2026-11-25).
    m.loss_kernel = "auto"
    # shared expert + top-2 of 16, each 1024 wide: 3 x 2 x 768 x 1024 = 4.7M active, d12's MLP size
    m.moe.n_experts, m.moe.top_k, m.moe.expert_hidden = 16, 2, 1024
    # Value width 16 (MegaCpp's own): on an H200 the R mixer takes 4.07 ms against 6.87 at 64, the whole
    # step 3.8% less, at 0.4779 against 0.4827 bits/byte after 9.8M tokens (BENCHMARKS.md, quality).
    m.rnn.n_heads, m.rnn.key_dim, m.rnn.value_dim = 6, 64, 16
    # At 8192 tokens on an H200 the R blocks' backward spiked to 2.2e4 without the cap and stayed <= 10
    # with it, at the same bits/byte per token (0.460 vs 0.465 at 15M tokens) and ~1% step time
    # (BENCHMARKS.md, issue 13).
    m.rnn.w_spectral_cap = 1.0
    m.ffn.hidden = 3072
    cfg.data.seq_len = 2048
    cfg.train.batch_size = 16
    cfg.train.steps = 5000
    cfg.train.out_dir = "runs/small"
    cfg.data.vocab_size = 32768
    # M, R and E at half the learning rate: on one H200 at 8192 tokens, 0.475 against 0.512 bits/byte
    # in the same 120 s and 7 gradient-norm spikes instead of 23 (BENCHMARKS.md, issue 13).
    cfg.optim.lr_scale_by_kind = ["M=0.5", "R=0.5", "E=0.5"]
    # Three Newton-Schulz iterations for the routed experts' 320 matrices (five for the rest): on an H200 the
    # step's device time 99.3 against 102.7-103.1 ms, and 0.4574 against 0.4576 bits/byte after 13M tokens, the
    # mean of three seeds, each pair within 0.0006 (BENCHMARKS.md, optimizer step, E1-E3).
    cfg.optim.expert_ns_steps = 3
    # The compiled regions replayed as CUDA graphs on one GPU: on an H200 the median step 0.5-1.8% faster and the
    # slowest tenth of the steps at 306-323k tok/s instead of 273-318k, the host no longer pacing the GPU
    # (BENCHMARKS.md, G1-G3).
    cfg.compile.cudagraphs = "auto"
    return cfg


def dense_of(cfg: Config) -> Config:
    """`cfg` (a copy) as its dense baseline: pattern ``AF`` and base learning rates for every kind."""
    out = copy.deepcopy(cfg)
    out.model.pattern = "AF"
    # small's factors name kinds dense has none of; A at half rate measured within run-to-run noise
    # (0.352 against 0.356 bits/byte at best, BENCHMARKS.md), so every kind keeps the base rates.
    out.optim.lr_scale_by_kind = []
    out.optim.expert_ns_steps = None  # no experts
    return out


def dense() -> Config:
    cfg = dense_of(small())
    cfg.train.out_dir = "runs/dense"
    return cfg


def nam52() -> Config:
    cfg = _defaults()
    m = cfg.model
    m.d_model, m.depth, m.pattern = 2048, 52, "AEMEAEMEAEMR"
    m.attention.n_heads, m.attention.n_kv_heads, m.attention.head_dim = 16, 4, 128
    m.mamba.d_state, m.mamba.expand, m.mamba.head_dim = 128, 2, 64
    m.moe.n_experts, m.moe.top_k, m.moe.expert_hidden = 64, 4, 1024
    # Value width 16, as `small` and MegaCpp's own M2RNN: on an H100 at these shapes the R sublayer takes 7.2 ms
    # against 11.7 at 64 (BENCHMARKS.md, nam52's shapes, N3).
    m.rnn.n_heads, m.rnn.key_dim, m.rnn.value_dim = 16, 64, 16
    # R's W kept at spectral norm <= 1, as `small`: cut to depth 12 on one H200 (300 steps of 4 x 4096) Muon pushed
    # every head's W past 1 at every step (all 16 capped), the mechanism behind `small`'s R spikes at 8192 tokens;
    # the cap cost 0.3% of the step (99,333 against 99,613 tok/s), with 0.6191 against 0.6275 bits/byte at step
    # 300 and the gradient spikes of both runs starting in M and A blocks, not R (BENCHMARKS.md, Q4).
    m.rnn.w_spectral_cap = 1.0
    # bf16 scan operands and the fused Triton scan on CUDA, as `small` (the reference on CPU): on an H100 at these
    # shapes the compiled M sublayer takes 10.1 ms against 22.7 with fp32 operands and the reference scan, and
    # 25.6 with fp32 operands and the Triton scan (N3).
    m.mamba.scan_matmuls = "activation"
    m.mamba.scan_kernel = "auto"
    # The fused loss head on CUDA (the reference on CPU): at these shapes (B4 x T4096, vocab 65536) on an
    # H200 the compiled head took 21.4 ms instead of 22.5, and 21.9 instead of 44.1 uncompiled, with 2.9
    # GiB of peak memory instead of 16.3 (BENCHMARKS.md, nam52's shapes).
    m.loss_kernel = "auto"
    m.ffn.hidden = 8192
    cfg.data.seq_len = 4096
    cfg.train.batch_size = 4
    cfg.train.steps = 50000
    cfg.train.out_dir = "runs/nam52"
    # A save takes 58-80 s on 4 H200s (gathering 27 GB of fp32 weights to rank 0, which writes and hashes them;
    # BENCHMARKS.md J4) against ~0.6 s a step: every 200 steps, the default, that was ~50% more time; every
    # 1,000 it is ~10-13%, at most ~10 minutes of training lost to a crash.
    cfg.train.ckpt_every = 1000
    # 6.5B parameters: keeping every gathered block resident would cost ~26 GB of fp32 weights per GPU.
    cfg.dist.reshard_after_forward = True
    cfg.data.vocab_size = 65536
    # Three Newton-Schulz iterations for the routed experts, as `small`: cut to depth 12 on one H200, 166 against
    # 188 ms per step, and 0.6087 against 0.6080 bits/byte after 400 steps at 4 x 4096, the mean of two seeds
    # (+0.0011, +0.0002), which the 13% more tokens per minute outweigh (BENCHMARKS.md, optimizer step, E6).
    cfg.optim.expert_ns_steps = 3
    # M, R and E at half the learning rate, as `small`: cut to depth 12 on one H200 (400 steps of 4 x 4096, one
    # seed), 0.5603 against 0.6289 bits/byte at step 400 and 0.6611 against 0.6885 at 200, the training loss
    # lower in every window, the same five gradient-norm spikes and tokens/s (BENCHMARKS.md, Q5).
    cfg.optim.lr_scale_by_kind = ["M=0.5", "R=0.5", "E=0.5"]
    return cfg


PRESETS: dict[str, Callable[[], Config]] = {"tiny": tiny, "small": small, "dense": dense, "nam52": nam52}


def preset(name: str) -> Config:
    """A fresh copy of the named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}")
    return PRESETS[name]()
