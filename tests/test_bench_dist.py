"""benchmarks/runs/bench_dist.py's variant names: what each one runs, and which runs its scaling lines
compare (the names the node-scale study uses: small on 1-8 GPUs, nam52 with expert parallelism)."""
from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks" / "runs"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_dist
    return bench_dist


def test_tier1_small_variants_name_gpus_batch_accumulation_and_strategy(bench):
    assert bench.plan("small-1", 8) == (1, ["--train.batch_size=16", "--train.grad_accum=1", "--dist.strategy=auto"],
                                        "small")
    assert bench.plan("small-2-b8", 8)[:2] == (2, ["--train.batch_size=8", "--train.grad_accum=1",
                                                   "--dist.strategy=auto"])
    assert bench.plan("small-1-acc2", 8)[1][1] == "--train.grad_accum=2"
    assert bench.plan("small-2-fsdp", 8)[1][2:] == ["--dist.strategy=fsdp"]
    assert bench.plan("small-8-hsdp4", 8)[:2] == (8, ["--train.batch_size=16", "--train.grad_accum=1",
                                                      "--dist.strategy=hsdp", "--dist.shard_size=4"])


def test_tier1_nam52_variants_take_every_visible_gpu_unless_named(bench):
    assert bench.plan("nam52", 8) == (8, [], "nam52")
    assert bench.plan("nam52-d26-g4-ep2-fsdp", 8) == (
        4, ["--model.depth=26", "--dist.expert_parallel=2", "--dist.strategy=fsdp"], "nam52")


def test_tier1_nanochat_variants_run_the_anchor_at_a_per_gpu_batch(bench):
    assert bench.plan("nanochat-1", 8) == (1, ["--batch=16"], "nanochat")
    assert bench.plan("nanochat-4-b8", 8) == (4, ["--batch=8"], "nanochat")


@pytest.mark.parametrize(("name", "expected"), [
    ("small-2-hsdp", "strategy 'hsdp' is not"), ("small-2-fsdp2", "strategy 'fsdp2' is not"),
    ("small", "unknown variant 'small'"), ("nam52-ep", "strategy 'ep' is not"),
    ("nanochat-2-fsdp", "unknown variant 'nanochat-2-fsdp'")])
def test_tier1_a_bad_variant_name_is_one_line(bench, name, expected):
    with pytest.raises(SystemExit) as info:
        bench.plan(name, 8)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_tier1_scaling_lines_pair_each_several_gpu_run_with_the_one_gpu_run_of_its_batch(bench):
    names = ["small-1", "small-1-b8", "small-2", "small-8", "small-2-b8", "small-4-fsdp", "small-2-acc2", "nam52"]
    assert bench.scaling_pairs(names) == [
        ("small-2", "small-1", "same per-GPU batch, auto"), ("small-8", "small-1", "same per-GPU batch, auto"),
        ("small-2-b8", "small-1-b8", "same per-GPU batch, auto"),
        ("small-4-fsdp", "small-1", "same per-GPU batch, fsdp"),
        ("small-2-b8", "small-1", "same global batch")]


def test_tier1_nanochat_runs_pair_with_the_one_gpu_anchor_of_their_batch(bench):
    names = ["nanochat-1", "nanochat-2", "nanochat-4", "nanochat-2-b8", "small-1", "small-4"]
    assert bench.scaling_pairs(names) == [
        ("nanochat-2", "nanochat-1", "same per-GPU batch, nanochat's own"),
        ("nanochat-4", "nanochat-1", "same per-GPU batch, nanochat's own"),
        ("small-4", "small-1", "same per-GPU batch, auto")]


def test_tier1_each_ranks_first_step_split_is_read_from_its_log(bench, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank10.log").write_text("2026-11-26 10:00:03 first step 9.0 s: forward 9.0 s\n")
    (logs / "rank2.log").write_text("2026-11-26 10:00:01 warmup done\n"
                                    "2026-11-26 10:00:02 first step 72.9 s: data 0.0 s, backward 35.0 s\n"
                                    "2026-11-26 10:00:02 auto-fit attempt 1: first step done 83.2 s after\n")
    (logs / "rank3.log").write_text("2026-11-26 10:00:01 out of memory\n")
    assert bench._first_step_lines(tmp_path) == ["rank2: first step 72.9 s: data 0.0 s, backward 35.0 s",
                                                 "rank10: first step 9.0 s: forward 9.0 s"]
