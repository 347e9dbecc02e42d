"""hsdp (``dist.strategy = hsdp``): FSDP2 over a 2-D (replicas, shards) mesh. Multi-process checks run
under torchrun (gloo, CPU), each launch under a wall-clock limit so that a hang fails its test. Four
ranks as 2 replicas x 2 shards (``dist.shard_size = 2``: on CPU torchrun's LOCAL_WORLD_SIZE is every
rank), `tiny` at toy width, 1 row per rank; the runs one comparison needs are shared by a fixture.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from megacpp.distributed.config import DistConfig
from megacpp.distributed.context import DistContext, DistError, local_world_size
from megacpp.distributed.strategy import check_hsdp, choose_strategy, hsdp_layout, shard_group_size
from megacpp.runtime.checkpoint import list_checkpoints
from tests.helpers import write_corpus
from tests.test_dist_train import LAUNCH, args, errors, launch, losses, same_error_on_both_ranks
from tests.torchrun import python, torchrun

HSDP = {"dist.strategy": "hsdp", "dist.shard_size": "2"}
FOUR = {"train.batch_size": "1", "train.steps": "6"}  # 4 ranks x 1 row: the global batch of 1 process x 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp") / "corpus"
    write_corpus(root)
    return root


def records(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def largest_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- settings, no processes


def test_shard_size_zero_means_the_ranks_torchrun_started_on_this_host(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_world_size() == 8 and shard_group_size(DistConfig(strategy="hsdp")) == 8
    assert shard_group_size(DistConfig(strategy="hsdp", shard_size=2)) == 2
    assert local_world_size({}) == 1  # outside torchrun


def test_the_layout_in_words_says_when_hsdp_is_fsdp():
    assert hsdp_layout(16, 8) == "2 replicas x 8 shards"
    assert hsdp_layout(4, 4) == "1 replica x 4 shards: fsdp's layout"


def test_auto_never_picks_hsdp(monkeypatch):
    model = nn.Linear(8, 8)
    for memory in (1, 2**40):  # too small to replicate, and roomy
        monkeypatch.setattr("megacpp.distributed.strategy.device_memory", lambda _device, m=memory: m)
        strategy, _ = choose_strategy("auto", model, 10**6, DistContext(world_size=8))
        assert strategy in ("replicate", "fsdp")


@pytest.mark.parametrize(("settings", "world", "named"), [
    ({"shard_size": 3}, 4, "dist.shard_size = 3 does not divide the 4 rank(s) of this job"),
    ({"shard_size": 0}, 6, "dist.shard_size = 0 (0: this host's 4 rank(s), torchrun's LOCAL_WORLD_SIZE) does not "
                           "divide the 6 rank(s)"),
    ({"shard_size": 2, "expert_parallel": 2}, 4, "dist.strategy = hsdp with dist.expert_parallel = 2"),
])
def test_hsdp_settings_that_cannot_work_are_one_line(monkeypatch, settings, world, named):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(DistError, match="^" + named.replace("(", r"\(").replace(")", r"\)")) as caught:
        check_hsdp(DistConfig(strategy="hsdp", **settings), DistContext(world_size=world))
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- Muon on the 2-D mesh


@pytest.mark.slow
def test_tier1_sharded_muon_on_a_replicas_by_shards_mesh_equals_single_device_muon():
    """Bitwise, 4 steps on 2 replicas x 2 shards: every matrix orthogonalized whole by an owner of its own
    shard group (the all-to-alls on the Shard(0) dimension's group), the second moments laid out like
    their parameters. Muon on each rank's rows, or an exchange over all 4 ranks, would differ."""
    launch_ = torchrun(["tests/distributed/muon_parity.py", "--replicas", "2"], nproc=4, timeout=240).check()
    assert launch_.output.count("PASS") == 4


# ---------------------------------------------------------------- training against fsdp and one process


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
    """Uninterrupted 6-step runs: hsdp and fsdp on 4 ranks, and one process at the same global batch."""
    root = tmp_path_factory.mktemp("straight")
    hsdp = launch(root / "hsdp", corpus, nproc=4, timeout=300, **FOUR, **HSDP).check()
    launch(root / "fsdp", corpus, nproc=4, timeout=300, **FOUR, **{"dist.strategy": "fsdp"}).check()
    python(["-m", "megacpp.cli", *args(root / "one", corpus, **{**FOUR, "train.batch_size": "4"})], timeout=240).check()
    return root, hsdp.output


@pytest.mark.slow
def test_tier3_hsdp_matches_fsdp_and_one_process_at_the_same_global_batch(straight):
    """Muon (matrices) and AdamW (embeddings, head, norms) over 6 steps. hsdp and fsdp average the ranks'
    gradients in another order (reduce-scatter in each pair, then all-reduce across the pairs, against one
    reduce-scatter over 4): the fp32 sums differ in the last bit, and Muon's bf16 Newton-Schulz can turn
    that into bf16 rounding differences of an update (measured: equal to step 5, 1e-6 apart at step 6,
    1.3e-4 by step 8); bound 1e-4. Against one process: fsdp's bound against one process (2e-3, the
    same rounding, measured 8.6e-4 by step 8 on 2 ranks)."""
    root, output = straight
    assert "; data parallelism: hsdp (2 replicas x 2 shards, dist.strategy)" in output
    hsdp, fsdp, one = (losses(root / name / "run") for name in ("hsdp", "fsdp", "one"))
    assert len(hsdp) == len(fsdp) == len(one) == 6
    assert hsdp[0] == fsdp[0] and abs(hsdp[0] - one[0]) <= 1e-5  # step 1: the same weights and batch
    assert largest_gap(hsdp, fsdp) <= 1e-4
    assert largest_gap(hsdp, one) <= 2e-3
    assert hsdp != one, "identical to the bit would mean the ranks did not split the batch"


@pytest.mark.slow
def test_tier3_part_gradient_norms_count_each_replicas_rows_once(straight):
    """Step 1's per-part norms: every replica holds the same gradient rows, which must be counted once
    (counted per replica they would read sqrt(2) times fsdp's). Within 1e-5 relative: the same gradients
    reduced in another order (fp32, 1e-7), then squared and summed."""
    root, _ = straight
    hsdp, fsdp = records(root / "hsdp" / "run")[0], records(root / "fsdp" / "run")[0]
    parts = [key for key in fsdp if key.startswith("grad_norm_")]
    assert len(parts) >= 5
    for key in parts:
        assert abs(hsdp[key] - fsdp[key]) <= 1e-5 * fsdp[key], key


@pytest.mark.slow
def test_an_hsdp_checkpoint_holds_whole_tensors(straight):
    root, _ = straight
    saved = load_file(list_checkpoints(root / "hsdp" / "run")[0] / "model.safetensors")
    single = load_file(list_checkpoints(root / "one" / "run")[0] / "model.safetensors")
    assert saved.keys() == single.keys()
    assert all(saved[k].shape == single[k].shape for k in saved)


# ---------------------------------------------------------------- resume across strategies


def interrupted(run_root, corpus, **settings: str):
    """A 4-rank run stopped before step 4: its step-3 checkpoint is the newest."""
    result = launch(run_root, corpus, "interrupt@0:4", "interrupt@1:4", "interrupt@2:4", "interrupt@3:4", nproc=4,
                    timeout=300, **FOUR, **settings)
    assert result.returncode != 0 and [p.name for p in list_checkpoints(run_root / "run")] == ["step_00000003"]


@pytest.mark.slow
def test_tier1_an_hsdp_checkpoint_loads_under_fsdp_and_one_rank_and_resumes_bitwise(tmp_path, corpus, straight):
    """The step-3 checkpoint of an interrupted hsdp run loads bit-identically (weights, moments) on 2 fsdp
    ranks and on 1 rank at the same global batch; resumed under hsdp, the losses to step 6 and the final
    weights equal the uninterrupted run's bitwise."""
    root, _ = straight
    broken = tmp_path / "broken"
    interrupted(broken, corpus, **HSDP)
    for nproc, batch, strategy in ((2, "2", "fsdp"), (1, "4", "fsdp")):
        inspect = args(broken, corpus, **{**FOUR, "train.batch_size": batch, "dist.strategy": strategy})
        result = torchrun(["tests/distributed/inspect_run.py", *inspect], nproc=nproc, timeout=120).check()
        assert result.output.count("PASS") == nproc
    torchrun([LAUNCH, *args(broken, corpus, **FOUR, **HSDP), "--resume"], nproc=4, timeout=300).check()
    assert losses(broken / "run") == losses(root / "hsdp" / "run")
    a = load_file(list_checkpoints(root / "hsdp" / "run")[0] / "model.safetensors")
    b = load_file(list_checkpoints(broken / "run")[0] / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_tier3_an_fsdp_checkpoint_resumes_under_hsdp_continuing_the_fsdp_run(tmp_path, corpus, straight):
    """An fsdp run interrupted before step 4 and resumed under hsdp: steps 1-3 are the fsdp run's own (bitwise
    those of the uninterrupted fsdp run), steps 4-6 continue it within hsdp's bound against fsdp (1e-4, as
    above: the gradients' sums in another order)."""
    root, _ = straight
    broken = tmp_path / "broken"
    interrupted(broken, corpus, **{"dist.strategy": "fsdp"})
    resumed = torchrun([LAUNCH, *args(broken, corpus, **FOUR, **HSDP), "--resume"], nproc=4, timeout=300).check()
    assert "data parallelism: hsdp (2 replicas x 2 shards" in resumed.output
    fsdp, mixed = losses(root / "fsdp" / "run"), losses(broken / "run")
    assert mixed[:3] == fsdp[:3] and len(mixed) == 6
    assert largest_gap(mixed, fsdp) <= 1e-4


# ---------------------------------------------------------------- compile health


@pytest.mark.slow
def test_hsdp_blocks_compile_with_zero_breaks_and_equal_graphs_on_every_rank(tmp_path, corpus):
    launch(tmp_path, corpus, nproc=4, timeout=500, **HSDP, **{
        "compile.mode": "blocks", "compile.backend": "aot_eager", "compile.forbid_recompiles": "true",
        "train.batch_size": "1", "train.steps": "4", "train.ckpt_every": "4"}).check()
    record = next(r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
                  if r["kind"] == "compile")
    assert record["graph_break_sites"] == 0 and record["recompiles_after_warmup"] == 0
    graphs = record["graphs_per_rank"]
    assert len(graphs) == 4 and len(set(graphs)) == 1 and graphs[0] > 0
    assert len(losses(tmp_path / "run")) == 4


# ---------------------------------------------------------------- mistakes stop every rank with one line


@pytest.mark.slow
def test_a_shard_size_that_does_not_divide_the_ranks_stops_both_with_one_line(tmp_path, corpus):
    result = launch(tmp_path, corpus, timeout=120, **{"dist.strategy": "hsdp", "dist.shard_size": "3"})
    assert "dist.shard_size = 3 does not divide the 2 rank(s) of this job" in same_error_on_both_ranks(result)
    assert "Traceback" not in "\n".join(line for line in result.output.splitlines() if line.startswith("[default"))


@pytest.mark.slow
def test_a_rank_with_another_strategy_stops_every_rank_before_the_mesh_is_built(tmp_path, corpus):
    result = launch(tmp_path, corpus, "strategy@1", timeout=120, **{"dist.strategy": "hsdp", "dist.shard_size": "1"})
    error = same_error_on_both_ranks(result)
    assert ("rank parity (before the data-parallel layout): strategy differs (rank 0: 'hsdp', rank 1: 'fsdp')"
            in error), errors(result)
    assert result.seconds < 60 and not list_checkpoints(tmp_path / "run")
