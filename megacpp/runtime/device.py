"""Device and precision choices shared by training, evaluation and sampling."""
from __future__ import annotations

import contextlib

import torch

from megacpp.errors import ConfigError
from megacpp.versions import torch_version

# Dense bf16 tensor-core peak per GPU, for MFU. Unknown devices report no MFU rather than a guess.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def resolve_device(name: str) -> torch.device:
    """``auto`` picks the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device = {name!r} but torch {torch_version()} sees no CUDA device")
    return device


def autocast_context(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on GPU; fp32 on CPU (CPU bf16 matmuls are slower than fp32 on most hosts)."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)

