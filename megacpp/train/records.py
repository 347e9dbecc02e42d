"""The per-step metrics records, written a step late, and the progress bar they drive.

A step's device figures (gradient norms, optimizer metrics) are copied to the host behind the work
that made them (`Readback`); reading them at once would wait for the optimizer step queued after them
and leave the GPU idle while the host queues the next forward. So a step's record waits, and is
written when the next step has been queued, or at once when an evaluation or checkpoint waits for the
device anyway. Writing a record also checks it for divergence (megacpp.train.guards).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from megacpp.runtime.evaluate import Evaluation
from megacpp.train.grad_norms import NormHistory, PartGradNorms
from megacpp.train.guards import DivergenceGuard
from megacpp.train.metrics import MetricsLogger
from megacpp.train.readback import Readback


@dataclass
class PendingRecord:
    """A step's metrics record whose device figures are on their way to the host."""
    step: int
    final: bool
    host: dict[str, float]  # loss, tokens/s, elapsed time
    device: Readback  # gradient norms and optimizer metrics
    tail: dict[str, float]  # MFU and peak memory, last in the record


class StepRecords:
    """Records of the steps (every ``log_every``-th and the last go to ``metrics``; rank 0 alone has
    one), the gradient-norm history, and the progress bar's figures."""

    def __init__(self, metrics: MetricsLogger | None, bar: tqdm, part_grad_norms: PartGradNorms,
                 guard: DivergenceGuard, log_every: int, flops_per_token: float, peak_flops: float | None) -> None:
        self.metrics = metrics
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops  # of one device; None where unknown (no MFU)
        self.bar = bar
        self.part_grad_norms = part_grad_norms
        self.guard = guard
        self.log_every = log_every
        self.norm_history = NormHistory()  # for the end-of-run line
        self.postfix: dict[str, str] = {}
        self.evaluation: Evaluation | None = None  # the last one, shown on the bar
        self._pending: PendingRecord | None = None

    def start(self, step: int, final: bool, host: dict[str, float], on_device: dict[str, Tensor | float],
              ranks: int, device: torch.device) -> None:
        """A step's record: its host figures now (``tok_per_s`` over ``ranks`` gives the MFU), its device
        figures copied behind the work that made them. The step before's record is written now: its
        figures arrived while this step was queued."""
        tail = {}
        if self.peak_flops:
            tail["mfu"] = self.flops_per_token * host["tok_per_s"] / ranks / self.peak_flops
        if device.type == "cuda":
            tail["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        record = PendingRecord(step, final, host, Readback(on_device), tail)
        if self._pending is not None:
            self._write(self._pending)
        self._pending = record

    def flush(self) -> None:
        """Write the held record now (an evaluation or checkpoint waits for the device anyway)."""
        if self._pending is not None:
            self._write(self._pending)
            self._pending = None

    def flush_after_stop(self) -> None:
        """A run stopped between steps keeps its last step's record. Best effort and unchecked: an error
        here would replace the one that stopped the run."""
        if self._pending is not None and self.metrics is not None:
            with contextlib.suppress(Exception):
                self._write(self._pending, check=False)
            self._pending = None

    def show_validation(self, evaluation: Evaluation) -> None:
        self.evaluation = evaluation
        self.bar.set_postfix({**self.postfix, "val_bpb": f"{evaluation.bpb:.3f}"}, refresh=False)

    def _write(self, pending: PendingRecord, check: bool = True) -> None:
        """Check a step for divergence (``check``), log its record and advance the progress bar."""
        device = pending.device.result()
        blocks = device.pop("block_grad_norms", None)
        record: dict[str, Any] = {**pending.host, **device}
        if blocks is not None:
            record["block_grad_norms"] = self.part_grad_norms.block_record(blocks)
        if "grad_norm" in record:
            self.norm_history.append(pending.step, record["grad_norm"], record.get("block_grad_norms"))
        record.update(pending.tail)
        if check:
            self.guard.check(pending.step, record["loss"], record.get("grad_norm"))
        if self.metrics is not None and (pending.step % self.log_every == 0 or pending.final):
            self.metrics.log(pending.step, "train", record)
        postfix = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tok_per_s']:,.0f}"}
        if "mfu" in record:
            postfix["mfu"] = f"{100 * record['mfu']:.1f}%"
        if self.evaluation is not None:
            postfix["val_bpb"] = f"{self.evaluation.bpb:.3f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        self.postfix = postfix

