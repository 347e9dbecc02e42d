"""On a CUDA machine: the M op's first forward has a helper process compile its backward's kernels into the
Triton cache this process launches from, so the backward itself compiles none.
Run with `python -m pytest -m gpu tests/test_gpu_kernel_prewarm.py`."""
from __future__ import annotations

import pytest
import torch

from megacpp.ops import kernel_prewarm, mamba3_fused
from tests.test_kernel_prewarm import _mixer_layout

pytestmark = pytest.mark.gpu


def _entries(cache) -> set[str]:
    """Triton's cache keeps one directory per compiled kernel."""
    return {p.name for p in cache.iterdir()} if cache.is_dir() else set()


@pytest.mark.parametrize("offset", [0, 3])
def test_tier2_the_backward_compiles_nothing_after_the_prewarm(offset, tmp_path, monkeypatch):
    """A fresh Triton cache, and sizes of the test's own (t = 333, n = 80)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_prewarm, "_submitted", {})
    device = torch.device("cuda", torch.cuda.current_device())
    inputs = _mixer_layout(2, 333, 4, 32, 2, 80, 8, torch.bfloat16, offset, device)
    y, _, states, y_pre = mamba3_fused._fused_fwd(*inputs, None, 32, torch.bfloat16)
    forward = _entries(tmp_path)
    assert kernel_prewarm.wait_all() == [0]
    warmed = _entries(tmp_path)
    assert len(warmed - forward) >= 5  # the gate, chunk and dB/dC kernels, the state kernel twice
    mamba3_fused._fused_bwd(*inputs, states, y_pre, torch.randn_like(y), None, 32, torch.bfloat16)
    torch.cuda.synchronize()
    new = {name: sorted(p.name for p in (tmp_path / name).iterdir()) for name in _entries(tmp_path) - warmed}
    assert not new, new  # what the backward still compiled: kernels (a .cubin) or launchers
