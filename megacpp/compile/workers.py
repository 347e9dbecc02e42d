"""Inductor's compile workers, started before the first compile instead of at it.

Inductor compiles Triton kernels in a pool of worker processes, but only once every worker is up: it
starts the pool at the process's first compile, and until the pool answers it compiles each kernel in
the calling process, one after the other. The first compiled region of a run (`HybridLM.segments` for
the hybrid) therefore compiled serially: on an H100 it took 29.2 s, of which 14.5 s were kernels
compiled one by one while 16 workers started (`small`, cold cache; BENCHMARKS.md, compilation).
Started when the run knows its device, the pool comes up while the data loads and the model builds.
"""
from __future__ import annotations

import torch

from megacpp.compile.config import CompileConfig


def start_compile_workers(cfg: CompileConfig, device: torch.device) -> bool:
    """Start Inductor's worker pool now (it keeps starting in the background) when this run will compile
    Triton kernels: compile on, the Inductor backend, a CUDA device. Whether it started one; Inductor's
    own switches (``TORCH_WARM_POOL=0``, ``TORCHINDUCTOR_COMPILE_THREADS=1``) still turn the pool off."""
    if device.type != "cuda" or cfg.mode == "none" or cfg.backend != "inductor":
        return False
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()
    return True
