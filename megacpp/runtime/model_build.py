"""The model built where it runs.

`HybridLM(cfg)` draws its initial weights from the default device's generator. On the CPU that is one
value at a time (torch's CPU normal_ is serial), and torchrun gives each rank one thread: `nam52` cut to
depth 12 (1.6B parameters) takes 19.1 s to build on this project's CI host (BENCHMARKS.md, P9), so the whole
6.8B about 80 s per rank. A 4-GPU run of `nam52` spent 62 s between its start and its first step with every
graph cached (J3); this is the likely bulk of it, not yet measured on a GPU host. On the GPU the draws are
kernels, and what is left is the modules' construction (0.03 s at depth 12 on the meta device). The values
then come from the device's generator: a seed gives other initial weights on CUDA than on the CPU
(docs/decisions.md), the same on every rank of one kind of GPU.
"""
from __future__ import annotations

import torch

from megacpp.model.config import ModelConfig
from megacpp.model.hybrid import HybridLM


def build_model(model_cfg: ModelConfig, device: torch.device) -> HybridLM:
    """`HybridLM(model_cfg)` with every parameter and buffer created and initialised on `device`."""
    with torch.device(device):
        return HybridLM(model_cfg)
