"""A step's figures brought to the host without draining the device's queue.

`float(tensor)` on a CUDA tensor waits for every kernel queued so far, so reading a value the step
computed early (its loss, its gradient norms) also waits for everything queued after it, and the GPU
then idles while the host queues the next work. `Readback` copies the tensors into pinned host memory
right behind the work that produced them and waits, when asked, for that copy alone.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from megacpp.optim.local import full_value


class Readback:
    """The values of ``{name: 0-d or 1-d tensor, or a Python number}``, copied when built and read by
    `result()`: 0-d tensors and numbers as floats, 1-d tensors as lists of floats. The values are
    exactly what `float(tensor)` and `tensor.tolist()` would give."""

    def __init__(self, values: Mapping[str, Tensor | float]) -> None:
        self.order = list(values)
        self.numbers: dict[str, float | list[float]] = {}
        tensors: dict[str, Tensor] = {}
        for name, value in values.items():
            if not isinstance(value, Tensor):
                self.numbers[name] = float(value)
                continue
            value = full_value(value).detach()  # a DTensor metric: its global value
            if value.dim() > 1:
                raise ValueError(f"Readback takes 0-d and 1-d tensors; {name} has shape {tuple(value.shape)}")
            if value.device.type == "cuda":
                tensors[name] = value
            else:  # nothing to wait for (e.g. a count kept on the CPU)
                self.numbers[name] = float(value) if value.dim() == 0 else [float(x) for x in value.tolist()]
        self.layout = [(name, t.dim(), t.numel()) for name, t in tensors.items()]
        self.event: torch.cuda.Event | None = None
        if not tensors:
            self.host = torch.empty(0, dtype=torch.float64)
            return
        # float64 holds every float32 and bfloat16 value exactly: one copy for all of them.
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors.values()])
        self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        self.host.copy_(flat, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def result(self) -> dict[str, float | list[float]]:
        if self.event is not None:
            self.event.synchronize()
        flat = self.host.tolist()
        read = dict(self.numbers)
        start = 0
        for name, dim, numel in self.layout:
            piece = flat[start:start + numel]
            read[name] = piece[0] if dim == 0 else piece
            start += numel
        return {name: read[name] for name in self.order}
