"""benchmarks/tools/host_timeline.py: a profiled step's host spans from a Chrome trace (D20's reading)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "benchmarks" / "tools"


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import host_timeline
    return host_timeline


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


# The main thread (tid 1) launches from 1000 us to 10000 us, the autograd thread (tid 2) runs 4000-7000 us;
# FSDP2's hook ranges named per block count as one name; one Muon step at 8000 us for 2000 us; the host
# waits 700 us in one synchronization (a launch is not a wait); a kernel is device time, not host time.
EVENTS = [
    _x("cpu_op", "aten::mm", 1000, 500), _x("user_annotation", "FSDP::pre_forward (blocks.0)", 1000, 1500),
    _x("user_annotation", "FSDP::pre_forward (blocks.1)", 3000, 600),
    _x("cpu_op", "autograd::engine", 4000, 3000, tid=2),
    _x("user_annotation", "Optimizer.step#Muon.step", 8000, 2000), _x("cpu_op", "aten::item", 9500, 500),
    _x("cuda_runtime", "cudaStreamSynchronize", 9300, 700), _x("cuda_runtime", "cudaLaunchKernel", 1000, 10),
    _x("kernel", "gemm", 500, 20000, tid=99), {"ph": "i", "cat": "cpu_op", "name": "instant", "ts": 0},
]


def test_tier1_the_timeline_of_a_synthetic_trace(tool):
    timeline = tool.host_timeline([e for e in EVENTS if e["ph"] == "X"])
    assert timeline["threads"] == [{"thread": "main", "events": 5, "first_ms": 0.0, "last_ms": 9.0},
                                   {"thread": "thread 2", "events": 1, "first_ms": 3.0, "last_ms": 6.0}]
    assert timeline["optimizer_steps"] == [{"name": "Optimizer.step#Muon.step", "start_ms": 7.0, "dur_ms": 2.0}]
    assert timeline["host_wait_ms"] == 0.7
    assert timeline["annotations"] == [{"name": "FSDP::pre_forward", "count": 2, "total_ms": 2.1},
                                       {"name": "Optimizer.step#Muon.step", "count": 1, "total_ms": 2.0}]


def test_the_command_reads_a_gzipped_trace_and_prints_the_spans(tool, tmp_path, capsys):
    trace = tmp_path / "rank0.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    assert tool.main([str(trace), "--top", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "main: 0.0 - 9.0 ms (5 events)", "thread 2: 3.0 - 6.0 ms (1 events)",
        "Optimizer.step#Muon.step: from 7.0 ms, 2.0 ms", "the host waited for the device 0.7 ms",
        "record_function ranges by host time, nested ones counted in each (top 1):",
        "       2.1 ms     2x  FSDP::pre_forward"]


def test_a_trace_without_host_events_is_one_error(tool):
    with pytest.raises(ValueError, match="no host events"):
        tool.host_timeline([_x("kernel", "gemm", 0, 10)])
