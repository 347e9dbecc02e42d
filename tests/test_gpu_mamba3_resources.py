"""The fused Mamba-3 Triton kernels fit one sm_90 (H100/H200) streaming multiprocessor at every preset's
sizes: shared memory and registers within the hard limits, spills within what each timed tiling was
measured with, as compiled by the installed Triton for that target (benchmarks/tools/check_mamba3_resources.py,
which prints the table, states the spill rule and takes other architectures).

Nothing runs on a GPU, but the check needs Triton's CUDA backend and its ptxas, which CPU CI lacks: the
`gpu` marker deselects it there; on a GPU machine: ``python -m pytest -m gpu tests/test_gpu_mamba3_resources.py``.
"""
from __future__ import annotations

import io
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

TOOLS = Path(__file__).resolve().parents[1] / "benchmarks" / "tools"


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import check_mamba3_resources
    return check_mamba3_resources


@pytest.mark.parametrize("preset", ["tiny", "small", "nam52"])
def test_fused_mamba3_kernels_fit_an_sm90_multiprocessor(tool, preset):
    from triton.backends.compiler import GPUTarget

    table = io.StringIO()
    over = tool.check([preset], list(tool.MODES), GPUTarget("cuda", 90, 32), batch=16, seq=2048,
                      max_shared=200 * 1024, max_spill=0, out=table)
    assert over == 0, table.getvalue()
