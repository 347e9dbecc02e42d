"""benchmarks/tools/hold_gpu_memory.py: how much it holds, and its argument errors (the holding itself
needs a GPU and ran on 2 x H200, BENCHMARKS.md D21)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "tools"))
from hold_gpu_memory import bytes_to_hold, parse_gpus  # noqa: E402

MIB = 2**20


def test_tier1_an_h200_keeps_an_h100s_capacity():
    # nvidia-smi's memory.total: H200 143,771 MiB, H100 80GB HBM3 81,559 MiB.
    assert bytes_to_hold(143_771 * MIB) == (143_771 - 81_559) * MIB
    assert bytes_to_hold(143_771 * MIB, target_bytes=40_000 * MIB) == 103_771 * MIB


def test_tier1_a_card_no_bigger_than_the_target_holds_nothing():
    assert bytes_to_hold(81_559 * MIB) == 0
    assert bytes_to_hold(40_960 * MIB) == 0


def test_tier1_negative_sizes_are_refused():
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        bytes_to_hold(-1)


def test_tier1_gpu_lists_parse_or_fail_clearly():
    assert parse_gpus("0,1") == [0, 1]
    assert parse_gpus("3") == [3]
    for bad in ("0,x", "", "0,0", "-1"):
        with pytest.raises(SystemExit, match="GPUs"):
            parse_gpus(bad)
