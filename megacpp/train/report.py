"""What a finished run and an evaluation print: the model's bits per byte beside the baselines."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megacpp.data.baselines import Baselines

if TYPE_CHECKING:
    from megacpp.train.loop import TrainResult

# The GPU figures a CPU run is put beside (BENCHMARKS.md: issue 10's 2-GPU table and issue 13).
GPU_REFERENCE = ("on one H200 the `small` preset reaches 0.70 bits/byte after 1.6M tokens and 0.43 after "
                 "29.5M tokens (900 steps, under 4 minutes) on that machine's torch headers; BENCHMARKS.md")


def beside_baselines(bpb: float, baselines: Baselines) -> str:
    """``validation X bits/byte (baselines on the validation split: ...)``."""
    return f"validation {bpb:.4f} bits/byte (baselines on the validation split: {baselines.short()})"


def run_summary(result: TrainResult) -> str:
    """The end-of-run lines; a CPU run says plainly that it is a smoke test."""
    why = " (train.time_budget_s spent)" if result.out_of_time else ""
    lines = [f"done: {result.step} steps{why}, {beside_baselines(result.val_bpb, result.baselines)}; "
             f"checkpoint {result.checkpoint}"]
    if result.grad_spikes:
        lines.append(result.grad_spikes)
    if result.device_type == "cpu":
        lines.append("note: a CPU run is a smoke test of the whole path (data, model, optimizer, checkpoint, "
                     f"sample), not a measure of what the model can learn: {GPU_REFERENCE}")
    return "\n".join(lines)


def eval_summary(bpb: float, baselines: Baselines, checkpoint: Path) -> str:
    return f"validation bits per byte: {bpb:.4f}  ({checkpoint})\n{baselines.summary()}"
