"""benchmarks/tools/device_kernels.py: a profiled step's device time by kernel family and name, and its idle gaps."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "benchmarks" / "tools"


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import device_kernels
    return device_kernels


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


# Two steps: a GEMM overlapping an NCCL kernel, one of megacpp's kernels, an Inductor kernel, a copy; a host op
# (not device time). Gaps: 5 µs (after the GEMM and the NCCL kernel end at 1100), 50 µs, 2000 µs.
EVENTS = [
    _x("kernel", "sm90_xmma_gemm_bf16", 0, 1000), _x("kernel", "ncclDevKernel_AllReduce", 500, 600),
    _x("kernel", "_fwd_scan_kernel", 1105, 95), _x("kernel", "triton_poi_fused_add_0", 1250, 50),
    _x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 3300, 100), _x("cpu_op", "aten::mm", 0, 4000),
]


def test_tier1_families_names_and_gaps_of_a_synthetic_trace(tool):
    table = tool.kernel_table(tool.device_events(EVENTS), steps=2)
    assert table["families"] == [("matmul", 0.5), ("collectives", 0.3), ("copies and fills", 0.05),
                                 ("megacpp triton", 0.0475), ("inductor triton", 0.025)]
    assert table["kernels"][0] == ("sm90_xmma_gemm_bf16", 0.5, 0.5)
    assert [(b["count"], b["ms"]) for b in table["gaps"]] == [(0.5, 0.0025), (0.5, 0.025), (0.0, 0.0), (0.5, 1.0)]


def test_tier1_family_falls_back_to_other(tool):
    assert tool.family("void at::native::vectorized_elementwise_kernel<4>") == "other"
    assert tool.family("flash_fwd_kernel") == "attention"
    assert tool.family("_ZN2at6native29vectorized_elementwise_kernel") == "other"  # mangled C++, not megacpp's
    assert tool.family("_bwd_bc_kernel") == "megacpp triton"


def test_tier1_the_command_line_prints_the_tables_and_refuses_zero_steps(tool, tmp_path, capsys):
    trace = tmp_path / "rank0.trace.json"
    trace.write_text(json.dumps({"traceEvents": EVENTS}))
    assert tool.main([str(trace), "--steps", "2", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "device busy 0.92 ms per step" in out and "over 1000 µs: 0.5 gaps, 1.00 ms" in out
    assert "_fwd_scan_kernel" not in out  # third by time: beyond --top 2
    assert "0.92 ms      2.5 events  not traced" in out  # these events carry no correlation id
    with pytest.raises(SystemExit):
        tool.main([str(trace), "--steps", "0"])
    with pytest.raises(SystemExit):
        tool.main([str(tmp_path / "missing.json")])
    assert "no such trace file" in capsys.readouterr().err


def _launch(tid: int, ts: float, correlation: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "pid": 0, "tid": tid,
            "args": {"correlation": correlation}}


def _kernel(name: str, ts: float, dur: float, correlation: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7,
            "args": {"correlation": correlation}}


def test_tier1_device_time_goes_to_the_optimizer_step_or_thread_that_launched_it(tool):
    """Thread 1 launches four kernels, so it is the main thread: one outside any range, two inside Muon's
    step and one inside AdamW's. Thread 2 launches one (the backward's thread). One kernel's launch is not
    in the trace."""
    events = [
        _launch(1, 0, 10), _launch(2, 5, 11), _launch(1, 100, 12), _launch(1, 120, 13), _launch(1, 200, 14),
        {"ph": "X", "cat": "cpu_op", "name": "Optimizer.step#Muon.step", "ts": 90, "dur": 50, "pid": 0, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "Optimizer.step#AdamW.step", "ts": 195, "dur": 15, "pid": 0, "tid": 1},
        _kernel("forward", 10, 600, 10), _kernel("backward", 700, 1000, 11), _kernel("ns_a", 1800, 300, 12),
        _kernel("ns_b", 2200, 100, 13), _kernel("adam", 2400, 60, 14), _kernel("lost", 2500, 200, 99),
    ]
    assert tool.launch_ranges(events, steps=2) == [
        ("thread 2", 0.5, 0.5), ("main thread", 0.3, 0.5), ("Muon.step", 0.2, 1.0), ("not traced", 0.1, 0.5),
        ("AdamW.step", 0.03, 0.5)]


def test_tier1_the_main_thread_is_the_one_that_launched_most_and_nested_ranges_go_innermost(tool):
    """Thread 1 makes five synchronizations and two launches, thread 2 three launches: thread 2 is the main
    thread. A launch inside Muon's range, itself inside a wrapping optimizer's, is Muon's in either order."""
    sync = [{**_launch(1, 10 + i, 200 + i), "name": "cudaStreamSynchronize"} for i in range(5)]
    launches = [_launch(1, 0, 1), _launch(1, 15, 2), *(_launch(2, i, 100 + i) for i in range(3))]
    kernels = [_kernel("a", 0, 10, 1), _kernel("b", 20, 10, 2), *(_kernel("c", 40 + i, 1, 100 + i) for i in range(3))]
    outer = {"ph": "X", "cat": "cpu_op", "name": "Optimizer.step#Wrapper.step", "ts": 12, "dur": 100, "pid": 0,
             "tid": 1}
    inner = {**outer, "name": "Optimizer.step#Muon.step", "ts": 14, "dur": 5}
    for ranges in ([outer, inner], [inner, outer]):
        table = dict((where, ms) for where, ms, _ in tool.launch_ranges([*sync, *launches, *ranges, *kernels], 1))
        assert table == {"thread 1": 0.01, "Muon.step": 0.01, "main thread": 0.003}
