"""benchmarks/runs/bench_dist.py's variant names: what each one runs, and which runs its scaling lines
compare (the names the node-scale study uses: small on 1-8 GPUs, nam52 with expert parallelism)."""
from __future__ import annotations

import argparse
import json
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


def _run_dir(path: Path, tok_per_s: list[float], ranks: int) -> Path:
    """A run directory as `megacpp train` leaves it: 4 x 8 tokens per rank and step, one train record per
    entry of `tok_per_s`, and a record cut short at the end (the job killed while writing it)."""
    path.mkdir()
    (path / "config.toml").write_text("[train]\nbatch_size = 4\ngrad_accum = 1\n\n[data]\nseq_len = 8\n")
    lines = [json.dumps({"step": step, "kind": "train", "loss": 10.0 - step, "tok_per_s": tok,
                         "tok_per_s_per_gpu": tok / ranks, "mfu": step / 100, "peak_mem_gib": 20.0 + step})
             for step, tok in enumerate(tok_per_s, start=1)]
    (path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 7, "kind": "tr')
    return path


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(out=str(tmp_path), gpus=2, steps=6, set=[], timeout_s=30.0)


def test_tier1_a_job_killed_after_its_steps_is_reported_from_the_steps_it_logged(bench, tmp_path, monkeypatch):
    # 2 ranks x 4 x 8 = 64 tokens a step; steps 4-6 (the second half) take 100, 100 and 50 ms
    _run_dir(tmp_path / "small-2", [16.0, 640.0, 320.0, 640.0, 640.0, 1280.0], ranks=2)
    monkeypatch.setattr(bench, "_torchrun", lambda *a: ("timeout", "profile, steps 3-5: x\n", 41.0))
    result = bench.run_variant("small-2", _args(tmp_path), {})
    assert not result["failed"]
    assert result["ended"] == "ended by --timeout-s after step 6"
    assert (result["first_step_s"], result["step_ms"], result["tok_s_gpu"]) == (4.0, 100.0, 320.0)
    assert (result["mfu"], result["peak_gib"], result["losses"][-1], result["wall"]) == (0.05, 26.0, 4.0, 41.0)
    assert result["profile"] == ["profile, steps 3-5: x"]


def test_tier1_a_job_that_exits_zero_has_no_ending_note(bench, tmp_path, monkeypatch):
    _run_dir(tmp_path / "small-2", [16.0, 640.0], ranks=2)
    monkeypatch.setattr(bench, "_torchrun", lambda *a: ("0", "", 9.0))
    result = bench.run_variant("small-2", _args(tmp_path), {})
    assert (result["ended"], result["step_ms"]) == ("", 100.0)
    assert bench._ending("1", 12) == "exit 1 after step 12"


def test_tier1_profiled_steps_are_left_out_of_the_timing_unless_they_are_all_there_is(bench, tmp_path, monkeypatch,
                                                                                      capsys):
    """Steps 4-6 are the second half; the profile covered 5-6 (a record per rank), so step 4 alone is timed
    (100 ms); where the profile covered the whole half, those steps are timed and the line says so."""
    def with_profile(name: str, first: int) -> None:
        run = _run_dir(tmp_path / name, [16.0, 640.0, 320.0, 640.0, 64.0, 64.0], ranks=2)
        profile = {"step": 6, "kind": "profile", "rank0": {"first": first, "last": 6},
                   "rank1": {"first": first, "last": 6}}
        text = (run / "metrics.jsonl").read_text().rsplit("\n", 1)[0]  # less the cut-short record
        (run / "metrics.jsonl").write_text(text + "\n" + json.dumps(profile) + "\n")

    monkeypatch.setattr(bench, "_torchrun", lambda *a: ("0", "", 9.0))
    with_profile("small-2", first=5)
    result = bench.run_variant("small-2", _args(tmp_path), {})
    assert (result["step_ms"], result["tok_s_gpu"], result["timed_profiled"]) == (100.0, 320.0, False)
    assert "profiled" not in capsys.readouterr().out
    with_profile("small-2-fsdp", first=3)
    result = bench.run_variant("small-2-fsdp", _args(tmp_path), {})
    assert (result["step_ms"], result["tok_s_gpu"], result["timed_profiled"]) == (1000.0, 32.0, True)
    assert "(timed on profiled steps only: the profiler slows them; run more steps)" in capsys.readouterr().out


@pytest.mark.parametrize("logged", [[], [16.0]])
def test_tier1_a_job_with_fewer_than_two_steps_fails_with_its_logs_tail(bench, tmp_path, monkeypatch, capsys,
                                                                        logged):
    if logged:
        _run_dir(tmp_path / "small-2", logged, ranks=2)
    monkeypatch.setattr(bench, "_torchrun", lambda *a: ("timeout", "compiling...\n", 30.0))
    assert bench.run_variant("small-2", _args(tmp_path), {}) == {"name": "small-2", "failed": True}
    printed = capsys.readouterr().out
    assert "small-2: FAILED (no end within --timeout-s, fewer than two steps logged)" in printed
    assert "compiling..." in printed
