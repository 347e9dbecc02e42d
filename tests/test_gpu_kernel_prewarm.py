"""On a CUDA machine: the M op's first forward compiles its backward's kernels in worker threads, so the
backward itself compiles none.
Run with `python -m pytest -m gpu tests/test_gpu_kernel_prewarm.py`."""
from __future__ import annotations

import pytest
import torch

from megacpp.ops import kernel_prewarm, mamba3_fused, mamba3_triton
from tests.test_kernel_prewarm import _mixer_layout

pytestmark = pytest.mark.gpu

BACKWARD_KERNELS = (mamba3_triton._gate_bwd_kernel, mamba3_triton._bwd_states_kernel,
                    mamba3_triton._bwd_chunk_kernel, mamba3_triton._bwd_bc_kernel)


def _compiled(device: torch.device) -> int:
    """Kernels in the in-memory caches of the backward's JIT functions for `device`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(len(fn.device_caches[index][0]) for fn in BACKWARD_KERNELS)


@pytest.mark.parametrize("offset", [0, 3])
def test_tier2_the_backward_compiles_nothing_after_the_prewarm(offset):
    """Sizes of their own (t = 333, n = 80), so no earlier test compiled these specializations."""
    device = torch.device("cuda", torch.cuda.current_device())
    inputs = _mixer_layout(2, 333, 4, 32, 2, 80, 8, torch.bfloat16, offset, device)
    before = _compiled(device)
    y, _, states, y_pre = mamba3_fused._fused_fwd(*inputs, None, 32, torch.bfloat16)
    kernel_prewarm.wait_all()
    warmed = _compiled(device)
    assert warmed >= before + len(BACKWARD_KERNELS)  # the state kernel twice: with and without a final gradient
    grad_y = torch.randn_like(y)
    mamba3_fused._fused_bwd(*inputs, states, y_pre, grad_y, None, 32, torch.bfloat16)
    torch.cuda.synchronize()
    assert _compiled(device) == warmed
