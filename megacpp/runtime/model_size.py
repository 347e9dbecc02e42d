"""Whether a model's weights can exist on this machine at all, decided before any of them is allocated.

A size typed one digit too long (``--model.ffn.hidden 100000000000``) used to end in an allocator
traceback from deep inside ``nn.Linear``. The model is built on the meta device first (shapes only, no
memory; even nam52 takes well under a second), and a run whose fp32 weights alone exceed host RAM (where
a CPU run builds them and a GPU run's checkpoints gather them) or the GPU's memory (where a GPU run builds
them) stops with one line that names the size and the largest parameter. Only the weights are counted, a
lower bound of what training holds (gradients, optimizer state and activations come on top), so a model
this check passes may still need the OOM auto-fit or a smaller batch, but one it refuses could never have
run.
"""
from __future__ import annotations

import os

import torch

from megacpp.errors import ConfigError
from megacpp.model.config import ModelConfig
from megacpp.model.hybrid import HybridLM

WEIGHT_BYTES = 4  # fp32 master weights


class ModelTooLarge(ConfigError):
    """The model's weights alone do not fit in this machine's memory."""


def host_memory_bytes() -> int | None:
    """Physical memory of this host, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_model_fits(model_cfg: ModelConfig, device: torch.device) -> None:
    """Raise `ModelTooLarge` when the fp32 weights of `model_cfg`'s model exceed host memory (where a CPU
    run builds them and a checkpoint gathers them) or, on CUDA, the device's memory (where it builds them)."""
    with torch.device("meta"):
        model = HybridLM(model_cfg)
    params = list(model.named_parameters())
    weights = WEIGHT_BYTES * sum(p.numel() for _, p in params)
    limits = [("this host", host_memory_bytes())]
    if device.type == "cuda":
        limits.append((torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory))
    for where, available in limits:
        if available is not None and weights > available:
            name, largest = max(params, key=lambda item: item[1].numel())
            raise ModelTooLarge(
                f"the model has {_count(weights // WEIGHT_BYTES)} parameters, {_bytes(weights)} of fp32 weights "
                f"alone, more than the {_bytes(available)} of memory of {where}; its largest parameter is "
                f"{name} {tuple(largest.shape)}: expected sizes that fit (model.d_model, depth, "
                f"ffn.hidden, moe.expert_hidden, data.vocab_size, ...); `megacpp params` lists every part")


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**20:.1f} MiB"
