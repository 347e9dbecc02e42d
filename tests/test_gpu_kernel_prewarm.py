"""On a CUDA machine: the first forward of the M, R and angle ops has a helper process compile the op's backward
kernels into the Triton cache this process launches from, so the backward itself compiles none.
Run with `python -m pytest -m gpu tests/test_gpu_kernel_prewarm.py`."""
from __future__ import annotations

import pytest
import torch

from megacpp.ops import kernel_prewarm, mamba3_fused
from megacpp.ops.m2rnn_scan import m2rnn_scan
from megacpp.ops.mamba3_angles import document_angles
from tests.test_kernel_prewarm import _mixer_layout

pytestmark = pytest.mark.gpu


def _entries(cache) -> set[str]:
    """Triton's cache keeps one directory per compiled kernel."""
    return {p.name for p in cache.iterdir()} if cache.is_dir() else set()


@pytest.mark.parametrize("offset", [0, 3])
def test_tier2_the_backward_compiles_nothing_after_the_prewarm(offset, tmp_path, monkeypatch):
    """A fresh Triton cache, and sizes of the test's own (t = 333, n = 80)."""
    _fresh_cache(tmp_path, monkeypatch)
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


def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_prewarm, "_submitted", {})
    monkeypatch.setattr(kernel_prewarm, "_per_name", {})


def _backward_compiles_nothing(tmp_path, output):
    assert kernel_prewarm.wait_all() == [0]
    warmed = _entries(tmp_path)
    output.square().sum().backward()
    torch.cuda.synchronize()
    new = {name: sorted(p.name for p in (tmp_path / name).iterdir()) for name in _entries(tmp_path) - warmed}
    assert not new, new


def test_tier2_the_recurrence_backward_compiles_nothing_after_the_prewarm(tmp_path, monkeypatch):
    """R's fast scan (sizes of the test's own: t = 45, two heads, key width 32, value width 64)."""
    _fresh_cache(tmp_path, monkeypatch)
    b, t, h, dk, dv = 3, 45, 2, 32, 64
    q, k = (torch.randn(b, t, h, dk, device="cuda") * 0.3 for _ in range(2))
    v = torch.randn(b, t, h, dv, device="cuda")
    f = torch.rand(b, t, h, device="cuda")
    W = torch.randn(h, dv, dv, device="cuda") / dv ** 0.5
    leaves = [x.requires_grad_() for x in (q, k, v, f, W)]
    _backward_compiles_nothing(tmp_path, m2rnn_scan(*leaves))


@pytest.mark.parametrize("documents", [False, True])
def test_tier2_the_angles_backward_compiles_nothing_after_the_prewarm(documents, tmp_path, monkeypatch):
    """rate and dt as slices of one projection, as the mixer hands them over."""
    _fresh_cache(tmp_path, monkeypatch)
    b, t, h, na = 2, 301, 4, 8
    proj = torch.randn(b, t, 64, device="cuda", requires_grad=True)
    rate, dt = proj[..., 5:5 + na], proj[..., 30:30 + h].sigmoid()
    offsets = (torch.arange(t, device="cuda") // 100 * 100).expand(b, t) if documents else None
    _backward_compiles_nothing(tmp_path, document_angles(rate, dt, offsets))
