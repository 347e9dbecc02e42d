"""Model configuration: the pattern, the widths, and one sub-config per block kind."""
from __future__ import annotations

from dataclasses import dataclass, field

from megacpp.model.attention import AttentionConfig
from megacpp.model.engram import EngramConfig
from megacpp.model.ffn import FFNConfig
from megacpp.model.m2rnn import M2RNNConfig
from megacpp.model.mamba3 import Mamba3Config
from megacpp.model.moe import MoEConfig
from megacpp.ops.softcap_xent import LossKernel
from megacpp.section import Section


@dataclass
class ModelConfig(Section):
    vocab_size: int = 4096  # replaced by the tokenizer's size when training
    d_model: int = 128
    depth: int = 10
    pattern: str = "AEMFR"
    norm_eps: float = 1e-6
    logit_softcap: float = 15.0  # final-logit soft cap; 0 = off
    # Implementation of the training loss head (megacpp/ops/softcap_xent.py): "auto" runs the fused
    # Triton loss on CUDA where it can (a soft-cap in (0, 40]) and the pure-PyTorch reference elsewhere
    # (CPU always); "reference" and "triton" force one ("triton" fails where it cannot run). The library
    # default stays "reference"; `small` and the GPU presets built on it turn "auto" on.
    loss_kernel: LossKernel = "reference"
    mtp_depth: int = 0  # multi-token-prediction heads (0 = off)
    mtp_loss_weight: float = 0.3
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mamba: Mamba3Config = field(default_factory=Mamba3Config)
    moe: MoEConfig = field(default_factory=MoEConfig)
    rnn: M2RNNConfig = field(default_factory=M2RNNConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    engram: EngramConfig = field(default_factory=EngramConfig)
