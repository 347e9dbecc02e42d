"""What the ops with a Triton fast path share: where Triton can run, for the setting that picks their
implementation (`megacpp.ops.kernel_choice.KernelChoice`). On CPU, Triton runs only under its
interpreter (TRITON_INTERPRET=1 before triton is imported): that is how the tests run the kernels
without a GPU, and never what `auto` picks there.
"""
from __future__ import annotations

import os

import torch

from megacpp.ops.kernel_choice import KernelChoice

# Read once at import, like triton itself does: under the interpreter the kernels run on CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The dtypes the kernels load and store.
TRITON_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def asks_for_triton(kernel: KernelChoice, device: torch.device) -> bool:
    """Whether a call tries the Triton path: "triton" always, "auto" on CUDA only (the interpreter must
    never take over the CPU default path)."""
    return kernel == "triton" or (kernel == "auto" and device.type == "cuda")


def triton_runs_on(device: torch.device) -> bool:
    """CUDA, or CPU under the interpreter."""
    return device.type == "cuda" or (INTERPRETED and device.type == "cpu")
