"""Inductor's compile workers start when the run knows it will compile Triton kernels (megacpp.compile.workers)."""
from __future__ import annotations

import pytest
import torch
import torch._inductor.async_compile as async_compile

from megacpp.compile.config import CompileConfig
from megacpp.compile.workers import start_compile_workers


@pytest.mark.parametrize(("device", "settings", "starts"), [
    ("cuda", {}, True),
    ("cuda:1", {"mode": "model"}, True),
    ("cpu", {}, False),
    ("cuda", {"mode": "none"}, False),
    ("cuda", {"backend": "aot_eager"}, False),
])
def test_tier1_workers_start_only_for_triton_compiles(monkeypatch, device, settings, starts):
    started = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: started.append(True))
    assert start_compile_workers(CompileConfig(**settings), torch.device(device)) is starts
    assert started == [True] * starts
