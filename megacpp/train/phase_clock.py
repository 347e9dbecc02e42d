"""Where the first training step's wall time goes.

The first step compiles: Dynamo and Inductor build the forward's regions when they are first called,
the backward's graphs when the backward first runs, and the optimizer step's graph inside its first
call. On `small` that step took 121-156 s against `dense`'s 40-48 s (issue 35). The per-region compile
times do not say which phase paid them (a region's backward graphs compile lazily, inside the backward)
nor what else the step waited for (a collective held by a slower rank). The clock splits the step into
its phases, waiting for the device at each mark so a phase's kernels count in it; it runs only until
warmup ends, since those waits would cost a steady step its overlap.

On CUDA it also reads the allocator's peak at each mark, so the line says which phase raised the run's
peak memory (`nam52` under fsdp peaked at 61.8 GiB on one tree and 46.5 GiB on an earlier one, and the
run's one peak figure could not say where the difference arose).
"""
from __future__ import annotations

import torch

from megacpp.runtime.phase_timer import PhaseTimer


class PhaseClock:
    """Wall seconds per phase of the steps run while `enabled` (the first step's, in training)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = True
        self._timer = PhaseTimer()
        # The allocator's peak (GiB) since the process started, read at each phase's end: a phase whose
        # reading exceeds the one before it raised the peak.
        self.peak_gib: dict[str, float] = {}

    @property
    def seconds(self) -> dict[str, float]:
        return self._timer.seconds

    def start(self) -> None:
        if self.enabled:
            self._timer.restart()

    def mark(self, phase: str) -> None:
        """The time since the last mark (or `start`) goes to `phase`, its device work included."""
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_gib[phase] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self._timer.mark(phase)

    def stop(self) -> dict[str, float]:
        """Stop timing; the phases' seconds so far."""
        self.enabled = False
        return dict(self.seconds)

    def line(self, what: str) -> str:
        """E.g. ``first step 121.3 s: data 0.1 s, forward 40.2 s, backward 35.0 s, optimizer step 46.0 s``,
        then on CUDA ``(peak memory after each: forward 30.1 GiB, backward 41.0 GiB, ...)``."""
        text = self._timer.line(what)
        if self.peak_gib:
            peaks = ", ".join(f"{phase} {gib:.1f} GiB" for phase, gib in self.peak_gib.items())
            text += f" (peak memory after each: {peaks})"
        return text
