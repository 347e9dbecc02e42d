"""The resource check's budgets (benchmarks/tools/check_mamba3_resources.py): which spills fail a kernel and
which are reported only. The tool imports Triton's CUDA backend, which Triton's wheels carry on CPU machines too;
compiling and reading ptxas's report is tests/test_gpu_mamba3_resources.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "benchmarks" / "tools"


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import check_mamba3_resources
    return check_mamba3_resources


def _usage(tool, spills: int, shared: int = 1024, registers: int = 128, threads: int = 128):
    return tool.Usage(shared=shared, registers=registers, spill_stores=spills, spill_loads=spills, threads=threads)


def test_tier1_a_timed_16_bit_tiling_fails_past_its_spill_budget(tool):
    budget = tool.spill_budget("bwd_chunk", torch.bfloat16, capped=False, max_spill=0)
    assert budget == 0
    assert tool.problems(_usage(tool, 0), 200 * 1024, budget) == []
    assert tool.problems(_usage(tool, 4), 200 * 1024, budget) == ["spills 4 B > 0"]


def test_tier1_the_dbdc_kernel_keeps_the_spills_it_was_timed_with(tool):
    budget = tool.spill_budget("bwd_bc", torch.float16, capped=False, max_spill=0)
    assert budget == 256
    assert tool.problems(_usage(tool, 200), 200 * 1024, budget) == []
    assert tool.problems(_usage(tool, 300), 200 * 1024, budget) == ["spills 300 B > 256"]


@pytest.mark.parametrize(("matmul", "capped"), [(torch.bfloat16, True), (torch.float32, False)])
def test_tier1_capped_and_fp32_operand_tilings_report_spills_but_keep_the_hard_limits(tool, matmul, capped):
    budget = tool.spill_budget("bwd_bc", matmul, capped=capped, max_spill=0)
    assert budget is None
    assert tool.problems(_usage(tool, 4096), 200 * 1024, budget) == []
    assert tool.problems(_usage(tool, 4096, shared=210 * 1024), 200 * 1024, budget) == [
        f"shared {210 * 1024} > {200 * 1024}"]
    assert tool.problems(_usage(tool, 0, registers=255, threads=512), 200 * 1024, budget) == [
        "255 registers x 512 threads > 65536"]
