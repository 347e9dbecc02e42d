"""What a finished, evaluated or interrupted run says: bits per byte beside the baselines, and how
a Ctrl-C left the run."""
from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from megacpp.data.baselines import Baselines
from megacpp.errors import Interrupted
from megacpp.runtime.evaluate import Evaluation


@dataclass
class TrainResult:
    """What a run ended with (megacpp.train.loop.train returns it)."""
    out_dir: Path
    step: int
    losses: list[float]
    evaluation: Evaluation | None  # the last validation figure, None when nothing was trained
    baselines: Baselines
    checkpoint: Path | None
    sample: str
    rank: int = 0  # under torchrun only rank 0 reports
    device_type: str = "cpu"
    out_of_time: bool = False  # train.time_budget_s ended the run before train.steps
    grad_spikes: str | None = None  # grad_norms.spike_summary of this process's steps


# The GPU figures a CPU run is put beside (BENCHMARKS.md: issue 10's 2-GPU table and issue 13).
GPU_REFERENCE = ("on one H200 the `small` preset reaches 0.70 bits/byte after 1.6M tokens and 0.43 after "
                 "29.5M tokens (900 steps, under 4 minutes) on that machine's torch headers; BENCHMARKS.md")


def beside_baselines(evaluation: Evaluation, baselines: Baselines) -> str:
    """``validation X bits/byte over N tokens (...) (baselines on the whole validation split: ...)``: the
    baselines always cover the whole split, and the figure says how much of it it covers."""
    return (f"validation {evaluation.bpb:.4f} bits/byte {evaluation.coverage()} (baselines on the whole "
            f"validation split: {baselines.short()})")


def run_summary(result: TrainResult) -> str:
    """The end-of-run lines; a CPU run says plainly that it is a smoke test."""
    why = " (train.time_budget_s spent)" if result.out_of_time else ""
    lines = [f"done: {result.step} steps{why}, {beside_baselines(result.evaluation, result.baselines)}; "
             f"checkpoint {result.checkpoint}"]
    if result.grad_spikes:
        lines.append(result.grad_spikes)
    if result.device_type == "cpu":
        lines.append("note: a CPU run is a smoke test of the whole path (data, model, optimizer, checkpoint, "
                     f"sample), not a measure of what the model can learn: {GPU_REFERENCE}")
    return "\n".join(lines)


def eval_summary(evaluation: Evaluation, baselines: Baselines, checkpoint: Path) -> str:
    return (f"validation bits per byte: {evaluation.bpb:.4f} {evaluation.coverage()}  ({checkpoint})\n"
            f"{baselines.summary()}")


def interruption(step: int, steps: int, checkpoint: Path, just_saved: bool, during: str | None = None,
                 redo: str | None = None, received: signal.Signals | None = None) -> Interrupted:
    """The error a Ctrl-C ends a run with, at ``step`` of ``steps``, with ``checkpoint`` saved for it (or
    ``just_saved`` by the step itself). ``during`` names the phase Ctrl-C cut short. A run already at
    ``steps`` is complete: instead of how to resume, the message says so, and ``redo`` (a format string
    of the checkpoint's ``{path}``) how to do what was skipped."""
    saved = (f"no checkpoint was due: {checkpoint} was just written" if just_saved
             else f"saved checkpoint {checkpoint}")
    how = "stopped by SIGTERM (a scheduler's preemption or shutdown)" if received == signal.SIGTERM \
        else "interrupted"
    what = f"{how} during {during} at step {step}" if during else f"{how} at step {step}"
    code = 128 + int(received) if received is not None else 130
    if step < steps:
        return Interrupted(f"{what}; {saved}", exit_code=code)
    if just_saved:
        saved = f"its final checkpoint {checkpoint} was written"
    redo_hint = "; " + redo.format(path=checkpoint) if redo else ""
    return Interrupted(f"{what}; {saved}; the run is complete (train.steps {steps}): nothing to resume{redo_hint}",
                       complete=True, exit_code=code)
