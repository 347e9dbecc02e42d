"""Whether the compiled regions replay as CUDA graphs, and the mark that starts each training step's graphs.

With `compile.cudagraphs` on, each region is compiled with Inductor's CUDA graph trees
(``mode="reduce-overhead"``): after one warmup call a region is recorded once per input shape, and later
calls replay its kernels in one launch. `small`'s step runs ~2,000 kernels; on one H200 launching them took
the host about as long as the GPU took to run them (~100 ms each, BENCHMARKS A9), so any hiccup of the host
left the GPU idle: stretches of steps at 270-300k tok/s among steps at 323k. Replayed, the same runs held
319-323k at their 10th percentile against 273-318k (BENCHMARKS G1).

One process on CUDA only: under torchrun FSDP2 gathers parameters into new storage every step, which a
graph would copy in (or re-record). Under `replicate`, with this check dropped, `small` on 4 H200s stopped at
its first replay: Inductor's graph trees found a tensor in their memory pool that no graph output accounts
for (BENCHMARKS.md, after V12). On 2 H200s it replayed and gained nothing: 309,846 tokens/s per GPU against
312,504 without, in one call (V13), where each rank's host already ran ahead of its device. Bitwise mode keeps
the path its tests pinned.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megacpp.compile.config import CompileConfig
from megacpp.errors import ConfigError


def decide_cudagraphs(cfg: CompileConfig, device: torch.device) -> tuple[bool, str]:
    """Whether regions compiled under ``cfg`` to run on ``device`` replay as CUDA graphs, and why (for the run
    header).

    ``on`` where graphs cannot run is a ConfigError naming what is missing; ``auto`` is on exactly where
    ``on`` would be accepted, outside bitwise mode."""
    if cfg.cudagraphs == "off":
        return False, "off (compile.cudagraphs off)"
    blockers = _blockers(cfg, device)
    if cfg.cudagraphs == "on":
        if blockers:
            raise ConfigError(f"compile.cudagraphs = 'on' needs {' and '.join(blockers)} (use auto or off)")
        return True, "on (compile.cudagraphs on)"
    if blockers:
        return False, f"off (auto: needs {' and '.join(blockers)})"
    if torch.are_deterministic_algorithms_enabled():
        return False, "off (auto: bitwise mode)"
    return True, "on (auto: one CUDA process)"


def _blockers(cfg: CompileConfig, device: torch.device) -> list[str]:
    """What this run lacks for CUDA graphs, in words (empty: nothing)."""
    missing = []
    if cfg.mode == "none" or cfg.backend != "inductor":
        missing.append("regions compiled by the inductor backend")
    if device.type != "cuda":
        missing.append(f"a CUDA device (the model runs on {device.type})")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        missing.append(f"one process (this run has {dist.get_world_size()})")
    return missing


def begin_graph_step() -> None:
    """Start a new generation of CUDA graph replays: the previous step's graph outputs may be overwritten.

    Called once per optimizer step, before its first forward: Inductor's own guess (a new step at every
    call of a compiled region without a pending backward) would free the documents' segments, computed
    by one region and read by every block after it, as soon as the first block is called."""
    torch.compiler.cudagraph_mark_step_begin()


def skipped_line() -> str | None:
    """The log line after the first step when Inductor declined to replay some compiled graphs (each then runs
    as compiled, kernel by kernel); None when every one replays."""
    from torch._dynamo.utils import counters

    skipped = counters["inductor"]["cudagraph_skips"]
    if not skipped:
        return None
    return (f"CUDA graphs: {skipped} compiled graph(s) not replayed (they run kernel by kernel); "
            "TORCH_LOGS=perf_hints names why")
