"""Shared timing for the benchmark scripts: median milliseconds per call, after warmup."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn


def median_ms(step: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """CUDA events around each call on a GPU (no host timing of asynchronous work); wall clock on CPU."""
    for _ in range(warmup):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_ms(step: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Median device milliseconds per call with the host's cost hidden, as in a training loop whose host
    runs ahead of the GPU: each call is queued behind a GPU spin (`torch.cuda._sleep`) of at least 50 ms
    and four times the call's host time, so the GPU finds all of it queued. `median_ms` instead starts
    each call on an idle GPU, which then also waits wherever the host launches slower than the GPU runs.
    A call the GPU reached before the host had queued it (a host stall longer than the spin) is timed
    again behind a spin twice as long; RuntimeError after three such retries (the call synchronizes
    with the host). CUDA only."""
    if device.type != "cuda":
        raise RuntimeError(f"device_ms needs a CUDA device, got {device}")
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe_cycles = 1 << 24
    start.record()
    torch.cuda._sleep(probe_cycles)
    end.record()
    end.synchronize()
    spin_ms = max(4 * host_ms, 50.0)
    cycles_per_ms = probe_cycles / start.elapsed_time(end)
    times = []
    while len(times) < iters:
        for retry in range(4):
            torch.cuda.synchronize(device)
            torch.cuda._sleep(int(cycles_per_ms * spin_ms * 2**retry))
            start.record()
            step()
            end.record()
            if not start.query():  # the spin still runs: the whole call is queued behind it
                break
        else:
            raise RuntimeError(f"device_ms: the GPU reached the call before the host had queued it, even "
                               f"behind a {spin_ms * 8:.0f} ms spin; the call synchronizes with the host")
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fwd_bwd_step(module: nn.Module, *inputs: torch.Tensor) -> Callable[[], None]:
    """Forward + backward (sum of the output) under bf16 autocast on the inputs' device."""
    def step() -> None:
        with torch.autocast(inputs[0].device.type, dtype=torch.bfloat16):
            out = module(*inputs)
        out.float().sum().backward()

    return step


def fwd_bwd_ms(module: nn.Module, *inputs: torch.Tensor, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of `fwd_bwd_step` (CUDA; CPU for smoke runs)."""
    return median_ms(fwd_bwd_step(module, *inputs), inputs[0].device, warmup, iters)


def graph_breaks() -> int:
    """Graph breaks Dynamo has counted since its counters were last cleared."""
    import torch._dynamo

    return sum(torch._dynamo.utils.counters["graph_break"].values())


# Kernel (CUDA) or operator (CPU) names that are matrix products: cuBLAS/cuBLASLt (gemm, xmma, nvjet),
# CUTLASS, and the aten products on a CPU profile.
MATMUL_WORDS = ("gemm", "xmma", "nvjet", "cutlass", "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def matmul_split(step: Callable[[], None], device: torch.device, calls: int = 3) -> tuple[float, float, int]:
    """(device ms per call, of which in matrix-product kernels, kernels per call) from torch.profiler,
    after one warmup call: what a step spends in its products against everything else (elementwise
    passes, copies, reductions). On a CPU the operators' own time stands in for kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    step()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind and (cuda or e.name.startswith("aten::"))]
    times = [(e.name.lower(), (e.device_time if cuda else e.self_cpu_time_total) / 1e3) for e in events]
    total = sum(t for _, t in times)
    matmul = sum(t for name, t in times if any(word in name for word in MATMUL_WORDS))
    return total / calls, matmul / calls, len(events) // calls


def kernel_ms(step: Callable[[], None], device: torch.device, calls: int = 3) -> dict[str, float]:
    """Device ms per call of each CUDA kernel name, from torch.profiler after one warmup call."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize(device)
    per_name: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            per_name[event.key] = per_name.get(event.key, 0.0) + event.device_time_total / calls / 1e3
    return per_name


@torch.no_grad()
def randomize_zero_weights(module: nn.Module, std: float) -> None:
    """Draw N(0, std) into every all-zero matrix of `module`: zero-initialised output projections would
    time GEMMs on zeros and send no gradient upstream."""
    for param in module.parameters():
        if param.dim() >= 2 and not param.any():
            param.normal_(std=std)
