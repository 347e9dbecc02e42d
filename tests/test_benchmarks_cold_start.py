"""benchmarks/runs/cold_start.py: variants and trees as a user names them, a run's figures from its files,
and the alternating order of fresh-cache runs (the runs themselves replaced by a stand-in that writes what
`megacpp train` writes)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cold():
    sys.path.insert(0, str(ROOT / "benchmarks" / "runs"))
    import cold_start

    return cold_start


def write_records(run_dir: Path, phases: dict[str, float], rates: dict[int, float]) -> None:
    run_dir.mkdir(parents=True)
    records = [{"step": s, "kind": "train", "loss": 3.0, "tok_per_s": r} for s, r in rates.items()]
    records.append({"step": max(rates), "kind": "compile", "graphs": 11, "first_step_phases_s": phases})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_tier1_variants_are_names_with_their_own_arguments(cold):
    assert cold.parse_variant("off=--compile.model_helper off --train.batch_size 8") == cold.Variant(
        "off", ("--compile.model_helper", "off", "--train.batch_size", "8"))
    assert cold.parse_variant("base=") == cold.Variant("base", ())
    for bad in ("off", "=--x 1"):
        with pytest.raises(SystemExit, match="expected NAME=ARGS"):
            cold.parse_variant(bad)


def test_tier1_a_tree_must_name_a_variant_and_hold_megacpp(cold, tmp_path):
    variants = [cold.Variant("a", ()), cold.Variant("b", ("--x", "1"))]
    (tmp_path / "old" / "megacpp").mkdir(parents=True)
    assert cold.with_trees(variants, [f"b={tmp_path / 'old'}"]) == [
        variants[0], cold.Variant("b", ("--x", "1"), (tmp_path / "old").resolve())]
    with pytest.raises(SystemExit, match="NAME one of a, b"):
        cold.with_trees(variants, [f"c={tmp_path / 'old'}"])
    with pytest.raises(SystemExit, match="holds no megacpp package"):
        cold.with_trees(variants, [f"a={tmp_path}"])


def test_tier1_a_runs_figures_come_from_its_metrics_and_log(cold, tmp_path):
    """First step = the sum of its phases (as the log line adds them); tok/s the median over the window
    only; the process's start to the first step from the supervisor's line."""
    phases = {"data": 0.5, "forward": 39.5, "backward": 13.25, "optimizer step": 5.25}
    write_records(tmp_path / "run", phases, {1: 10.0, 15: 1.0, 16: 300.0, 17: 100.0, 18: 200.0, 31: 1.0})
    log = tmp_path / "run.log"
    log.write_text("...\nauto-fit attempt 1: first step done 77.9 s after the process started (micro-batch 16)\n")
    run = cold.read_run("off", 2, "0", tmp_path / "run", log, (16, 30))
    assert run == cold.ColdRun("off", 2, "0", 58.5, phases, 77.9, 200.0)
    assert cold.run_row(run) == "| off | 2 | 0 | 58.5 | 39.5 | 13.2 | 5.2 | 77.9 | 200 |"


def test_tier1_a_run_that_never_started_is_a_row_of_dashes(cold, tmp_path):
    run = cold.read_run("on", 1, "timeout", tmp_path / "missing", tmp_path / "missing.log", (16, 30))
    assert run == cold.ColdRun("on", 1, "timeout")
    assert cold.run_row(run) == "| on | 1 | timeout | - | - | - | - | - | - |"


def test_tier1_rounds_alternate_each_run_with_a_fresh_cache_and_its_tree(cold, tmp_path, monkeypatch):
    old = tmp_path / "old"
    (old / "megacpp").mkdir(parents=True)
    calls = []
    first_steps = iter([60.0, 70.0, 50.0, 90.0])

    def fake_run(cmd, log, cwd, env, timeout_s):
        calls.append((cmd, cwd, env))
        if cmd[3] == "train":
            out = Path(cmd[cmd.index("--train.out_dir") + 1])
            write_records(out, {"forward": next(first_steps)}, {16: 1000.0})
            write_kernel(Path(env["MEGACPP_CACHE_DIR"]), "K", "_fwd_kernel")
        return "0"

    monkeypatch.setattr(cold, "run_logged", fake_run)
    out = tmp_path / "cold"
    monkeypatch.chdir(tmp_path)  # a relative --out still reaches the runs made in another tree's directory
    monkeypatch.setattr(sys, "argv", ["cold_start.py", "--out", "cold", "--rounds", "2", "--tree", f"b={old}",
                                      "a=--compile.model_helper on", "b=", "--", "--preset", "small"])
    cold.main()
    prepare, *trains = calls
    assert prepare[0][3:5] == ["data", "prepare"] and "--preset" in prepare[0]
    labels = [Path(cmd[cmd.index("--train.out_dir") + 1]).name for cmd, _, _ in trains]
    assert labels == ["a.1", "b.1", "a.2", "b.2"]
    caches = [env["MEGACPP_CACHE_DIR"] for _, _, env in trains]
    assert len(set(caches)) == 4 and all(Path(c).is_dir() for c in caches)
    assert [sorted(p.name for p in Path(c).rglob("*.json")) for c in caches] == [
        ["__grp___fwd_kernel.json", "_fwd_kernel.json"]] * 4  # fresh: only what its own run wrote
    assert [cwd for _, cwd, _ in trains] == [None, old.resolve(), None, old.resolve()]
    assert trains[1][2]["PYTHONPATH"].split(":")[0] == str(old.resolve())
    data = str(out / "data")
    assert all(cmd[cmd.index("--data.cache_dir") + 1] == data for cmd, _, _ in calls)
    assert "--compile.model_helper" in trains[0][0] and "--compile.model_helper" not in trains[1][0]
    summary = (out / "summary.md").read_text()
    assert "| a | 2 of 2 | 55.0 | 50.0-60.0 | - | 1,000 |" in summary
    assert "| b | 2 of 2 | 80.0 | 70.0-90.0 | - | 1,000 |" in summary
    assert "- b.2: megacpp kernels 1, compiled variants 1; more than one variant: none" in summary
    with pytest.raises(SystemExit, match="holds runs of an earlier call"):
        cold.main()


@pytest.mark.parametrize(("argv", "message"), [
    (["--rounds", "0", "a="], "--rounds 0: must be >= 1"),
    (["--timeout-s", "0", "a="], "--timeout-s 0.0: must be > 0 seconds"),
    (["a=", "a=--x 1"], "variant names repeat"),
])
def test_tier1_bad_settings_end_in_one_line_before_any_run(cold, tmp_path, monkeypatch, argv, message):
    monkeypatch.setattr(cold, "run_logged", lambda *a, **k: pytest.fail("nothing may run"))
    monkeypatch.setattr(sys, "argv", ["cold_start.py", "--out", str(tmp_path / "cold"), *argv])
    with pytest.raises(SystemExit, match=message):
        cold.main()
    assert not (tmp_path / "cold").exists()


def write_kernel(cache: Path, key: str, name: str) -> None:
    """A compiled kernel as Triton leaves it in its cache: a directory per variant, the metadata beside it."""
    entry = cache / "triton" / "0" / key
    entry.mkdir(parents=True)
    (entry / f"{name}.json").write_text(json.dumps({"name": name, "num_warps": 4}))
    (entry / f"__grp__{name}.json").write_text(json.dumps({"child_paths": {}}))
    (entry / f"{name}.cubin").write_bytes(b"")


def test_tier1_megacpps_kernel_variants_are_counted_from_the_triton_cache(cold, tmp_path):
    """Two variants of one kernel (a helper's and the run's own) show as a miss; Inductor's kernels and
    files that only look like metadata are not counted."""
    cache = tmp_path / "cache"
    write_kernel(cache, "A1", "_bwd_chunk_kernel")
    write_kernel(cache, "A2", "_bwd_chunk_kernel")
    write_kernel(cache, "B1", "_fused_bwd_kernel")
    write_kernel(cache, "C1", "triton_poi_fused_add_0")
    (cache / "fxgraph").mkdir()
    (cache / "fxgraph" / "_entry.json").write_text(json.dumps({"name": "something else"}))
    (cache / "fxgraph" / "_broken.json").write_text("{not json")
    assert cold.own_kernel_variants(cache) == {"_bwd_chunk_kernel": 2, "_fused_bwd_kernel": 1}
    run = cold.read_run("trace", 2, "0", tmp_path / "missing", tmp_path / "missing.log", (16, 30), cache)
    assert cold.kernels_line(run) == ("- trace.2: megacpp kernels 2, compiled variants 3; more than one variant: "
                                      "_bwd_chunk_kernel x2")
    assert cold.kernels_line(cold.ColdRun("a", 1, "timeout")) == "- a.1: no megacpp kernel in its cache"
