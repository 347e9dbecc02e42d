"""Compile an op's backward Triton kernels in the background while the forward goes on.

A Triton kernel compiles at its first launch, on the launching thread. megacpp's backward kernels are
first launched in the first step's backward, one after the other, where nothing else can run: that phase
took 14.5-14.8 s of `small`'s cold first step on an H100 against 0.5 s for `dense`, which has no kernels
of its own (BENCHMARKS.md, U1). Their launches are known as soon as the forward has run, since the
backward reads the forward's inputs with their layouts and allocates the rest itself. So at an op's
forward, the op describes its backward's launches on meta tensors (same shapes, strides, dtypes and
16-byte alignment as the real ones), and each is compiled by `JITFunction.warmup` in a worker thread:
the same specialization, hence the same entry in Triton's in-memory and on-disk caches as the real
launch, which then only looks it up. Triton's compile spends most of its time outside the GIL (MLIR
passes, LLVM, ptxas): on 2 cores, M's six kernels compiled in 6.6 s on six threads against 11.4 s in
turn. A description that differs from the real launch (an unforeseen layout) costs only the worker's
time: the real launch compiles as it would have.

Set ``MEGACPP_KERNEL_PREWARM=0`` to compile every kernel at its first launch instead.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

# Workers compiling at once: M's backward has four kernels, and two variants of one of them.
PREWARM_THREADS = 6
ENV_SWITCH = "MEGACPP_KERNEL_PREWARM"

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_submitted: dict[Hashable, list[Future]] = {}


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` are prewarmed: CUDA only (Triton's interpreter compiles nothing), and
    not switched off by the environment."""
    return device.type == "cuda" and os.environ.get(ENV_SWITCH, "1") != "0"


def tensor_key(*tensors: torch.Tensor | None) -> tuple:
    """What a Triton launch specializes on of each tensor (and what sizes the integer arguments), as a
    hashable key: shape, strides, dtype and the pointer's alignment to 16 bytes."""
    return tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % 16) for t in tensors)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with t's shape, strides, dtype and storage offset: its `data_ptr()` is the offset in
    bytes, so it is 16-byte aligned exactly where t is (CUDA allocations are)."""
    span = t.storage_offset() + 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    base = torch.empty(span, dtype=t.dtype, device="meta")
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def warm_in_background(name: Hashable, tensors: Sequence[torch.Tensor], device: torch.device,
                       describe: Callable[[], Sequence[Any]]) -> list[Future]:
    """Compile the launches `describe()` returns (objects with `kernel`, `grid`, `args`, `meta`, as
    `mamba3_triton.Launch`), each in a worker thread, once per `name` and layout of `tensors` (the inputs
    the launches derive from); the futures, empty when prewarming is off or this key was submitted before.
    `describe` runs on the calling thread (it builds meta tensors). A launch that fails to compile here
    fails again, and is reported, where the op really launches it."""
    if not enabled(device):
        return []
    key = (name, tensor_key(*tensors))
    with _lock:
        if key in _submitted:
            return []
        _submitted[key] = []
    futures = [_pool().submit(_warm, launch, device) for launch in describe()]
    _submitted[key] = futures
    return futures


def wait_all() -> None:
    """Wait for every submitted compile (raising the first failure)."""
    for futures in list(_submitted.values()):
        for future in futures:
            future.result()


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(PREWARM_THREADS, thread_name_prefix="megacpp-kernel-prewarm")
        return _executor


def _warm(launch: Any, device: torch.device) -> None:
    # Triton compiles for, and caches under, the thread's current device, which starts at 0 in a new thread.
    torch.cuda.set_device(device)
    launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.meta)
