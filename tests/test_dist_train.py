"""Multi-process training under torchrun (gloo, 2 CPU ranks): each launch runs under a wall-clock limit,
so a hang fails its test instead of stalling CI.

Faults are injected by tests/distributed/launch.py (test-only hooks applied before the CLI starts).
"""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from megacpp.runtime.checkpoint import MOMENTS_DIR, list_checkpoints, verify_checkpoint
from tests.helpers import tiny_train_args, write_corpus
from tests.torchrun import Launch, python, torchrun, two_nodes

pytestmark = pytest.mark.slow

LAUNCH = "tests/distributed/launch.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist") / "corpus"
    write_corpus(root)
    return root


def args(tmp_path, corpus, **overrides: str) -> list[str]:
    """tiny at toy width: 2 rows per rank, checkpoints every 3 steps, a fingerprint check every step."""
    base = {"train.batch_size": "2", "dist.fingerprint_every": "1"}
    return tiny_train_args(tmp_path, corpus, **{**base, **overrides})


def launch(tmp_path, corpus, *faults: str, nproc: int = 2, timeout: float = 240, **overrides: str) -> Launch:
    fault_args = [arg for f in faults for arg in ("--fault", f)]
    return torchrun([LAUNCH, *fault_args, *args(tmp_path, corpus, **overrides)], nproc, timeout)


def losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def errors(launch: Launch) -> list[str]:
    """The one-line errors the ranks printed."""
    return re.findall(r"^(?:\[default\d+\]:)?megacpp: (?:config )?error: (.*)$", launch.output, flags=re.M)


def same_error_on_both_ranks(launch: Launch) -> str:
    """The job failed, and each of the two ranks printed one and the same error line: returns it."""
    assert launch.returncode != 0
    found = errors(launch)
    assert len(found) == 2 and found[0] == found[1], launch.output[-3000:]
    return found[0]


# ---------------------------------------------------------------- 1. smoke, several hosts


def test_smoke_two_ranks_train_the_tiny_preset_with_a_checkpoint(tmp_path, corpus):
    result = torchrun(["-m", "megacpp.cli", *tiny_train_args(tmp_path, corpus, **{
        "train.batch_size": "2", "train.steps": "4", "train.ckpt_every": "4", "train.eval_every": "4"})]).check()
    out = tmp_path / "run"
    assert "done: 4 steps" in result.output
    assert "; data parallelism: replicate (auto: weights, gradients, buffers and 1/2 of the optimizer state take" \
        in result.output, "auto replicates a model this small"
    (ckpt,) = list_checkpoints(out)
    meta = verify_checkpoint(ckpt)
    assert meta["world_size"] == 2 and meta["global_batch"] == 4
    assert (out / "logs" / "rank0.log").is_file() and (out / "logs" / "rank1.log").is_file()
    assert (out / "sample.txt").is_file() and len(losses(out)) == 4
    # `megacpp eval --batches 2` on one process covers training's 2 validation batches of the 2 ranks' rows: the
    # same tokens and figure (before, its batches were one rank's rows: half the text)
    (val,) = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "val"]
    evaluated = python(["-m", "megacpp.cli", "eval", "--checkpoint", str(out), "--batches", "2"]).check()
    assert f"validation bits per byte: {val['val_bpb']:.4f} over {val['val_tokens']:,} tokens (" in evaluated.output


def test_two_hosts_of_one_rank_each_with_their_own_data_caches(tmp_path, corpus):
    """Two torchrun "nodes" meeting at one rendezvous address, each with a private data cache (as on
    hosts that share no disk but the run directory): they prepare their data separately, agree on it
    through the tokenizer hash and data key, and train."""
    train_args = args(tmp_path, corpus, **{"train.steps": "3", "data.cache_dir": "@node"})
    node_args = ["tests/distributed/launch_node.py", *train_args]
    results = two_nodes(node_args, timeout=240)
    for r in results:
        r.check()
    assert "done: 3 steps" in results[0].output
    assert (tmp_path / "node0-cache").is_dir() and (tmp_path / "node1-cache").is_dir()


def test_tier3_bf16_all_gather_opt_in_computes_with_bf16_weights(tmp_path, corpus):
    """dist.param_dtype = bfloat16: the blocks compute with bf16 copies of the weights. Step 1 (the same
    initial weights and batch) differs from the fp32 all-gather by bf16 rounding only: within 1e-2 of
    the loss, and not bit-equal (else the option did nothing)."""
    losses_by_dtype = {}
    for dtype in ("float32", "bfloat16"):
        launch(tmp_path / dtype, corpus, **{"train.steps": "2", "dist.param_dtype": dtype, "dist.strategy": "fsdp"}
               ).check()
        losses_by_dtype[dtype] = losses(tmp_path / dtype / "run")
    fp32, bf16 = losses_by_dtype["float32"], losses_by_dtype["bfloat16"]
    assert abs(fp32[0] - bf16[0]) <= 1e-2 and fp32[0] != bf16[0]


# ---------------------------------------------------------------- 2. parity at start


def test_tier1_fsdp_gather_schedule_settings_leave_the_losses_bitwise_unchanged(tmp_path, corpus):
    """dist.reshard_after_forward and dist.prefetch move the blocks' all-gathers in time (a second gather
    for the backward; gathers issued blocks ahead), never what is gathered or computed: 4 steps of fsdp
    with each give the default's losses bit for bit. The test model has 5 blocks, so prefetch 2 reaches
    past a block's neighbour in both directions."""
    runs = {"default": {}, "reshard": {"dist.reshard_after_forward": "true"}, "prefetch2": {"dist.prefetch": "2"}}
    found = {}
    for name, settings in runs.items():
        result = launch(tmp_path / name, corpus, **{"train.steps": "4", "dist.strategy": "fsdp", **settings}).check()
        assert "done: 4 steps" in result.output
        found[name] = losses(tmp_path / name / "run")
    assert len(found["default"]) == 4
    assert found["reshard"] == found["default"] and found["prefetch2"] == found["default"]


def test_a_setting_that_differs_on_one_rank_stops_both_ranks_naming_it(tmp_path, corpus):
    result = launch(tmp_path, corpus, "config@1", timeout=120)
    error = same_error_on_both_ranks(result)
    assert "config.optim.muon_lr differs (rank 0: 0.02, rank 1: 0.021)" in error
    assert result.seconds < 60
    assert not list_checkpoints(tmp_path / "run")


# ---------------------------------------------------------------- 3-5. compile health under each strategy


@pytest.fixture(scope="module", params=["replicate", "fsdp"])
def compiled_run(request, tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp(f"compiled-{request.param}")
    result = launch(tmp, corpus, timeout=500, **{
        "compile.mode": "blocks", "compile.backend": "aot_eager", "compile.forbid_recompiles": "true",
        "train.steps": "4", "train.ckpt_every": "4", "dist.strategy": request.param})
    return tmp / "run", result


def test_blocks_compile_with_zero_breaks_and_equal_graphs_on_both_ranks(compiled_run):
    run_dir, result = compiled_run
    result.check()
    record = next(json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["kind"] == "compile")
    assert record["graph_break_sites"] == 0
    assert record["graphs_per_rank"][0] == record["graphs_per_rank"][1] > 0


def test_no_recompiles_after_warmup_with_forbid_recompiles(compiled_run):
    run_dir, result = compiled_run
    result.check()
    record = next(json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["kind"] == "compile")
    assert record["recompiles_after_warmup"] == 0 and len(losses(run_dir)) == 4


def test_a_planted_graph_break_fails_on_every_rank(tmp_path, corpus):
    result = launch(tmp_path, corpus, "graph_break@0", "graph_break@1", timeout=400, **{
        "compile.mode": "blocks", "compile.backend": "eager", "train.steps": "3"})
    assert result.returncode != 0
    assert result.output.count("compile health bound exceeded after warmup") >= 2, result.output[-3000:]
    assert "ffn" in result.output.lower()


# ---------------------------------------------------------------- 6. batch and shape changes


def test_batch_change_on_both_ranks_recompiles_nothing_and_a_one_rank_shape_change_stops_both():
    result = torchrun(["tests/distributed/shape_change.py"], timeout=300)
    assert "both ranks: batch 2 -> 3 without a recompile" in result.output, result.output[-3000:]
    assert result.returncode != 0 and result.seconds < 200
    assert "RecompileError" in result.output and "rank 1" in result.output


# ---------------------------------------------------------------- 7. stalls and deaths


def test_a_rank_that_stalls_after_warmup_ends_the_job_within_seconds(tmp_path, corpus):
    result = launch(tmp_path, corpus, "stall@1:3", timeout=120, **{"dist.step_timeout_s": "5"})
    assert result.returncode != 0 and result.seconds < 60
    stacks = (tmp_path / "run" / "logs" / "stall_rank1.txt").read_text()
    assert "no progress for 5 s during step 3" in stacks
    assert "launch.py" in stacks and "train_step" in stacks, "every thread's stack, down to the stalled call"
    assert "rank 1: no progress for 5 s" in result.output


def test_a_rank_killed_with_sigkill_ends_the_job_within_seconds(tmp_path, corpus):
    result = launch(tmp_path, corpus, "kill@1:3", timeout=120, **{"dist.step_timeout_s": "20"})
    assert result.returncode != 0 and result.seconds < 60
    assert "SIGKILL" in result.output or "Signals.SIGKILL" in result.output or "exitcode  : -9" in result.output


# ---------------------------------------------------------------- 8. failures on one rank


def test_a_nonfinite_loss_on_one_rank_stops_every_rank_with_the_same_error(tmp_path, corpus):
    result = launch(tmp_path, corpus, "nan@1:4", **{"train.ckpt_every": "2", "train.steps": "6"})
    error = same_error_on_both_ranks(result)
    assert "step 4: loss is nan on rank(s) 1" in error
    assert "rank 1: first non-finite output at sublayer 2 (M: Mamba3)" in error
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000002"]
    verify_checkpoint(list_checkpoints(tmp_path / "run")[0])


def test_an_unwritable_checkpoint_on_one_rank_stops_every_rank_and_keeps_the_previous(tmp_path, corpus):
    first = launch(tmp_path, corpus, **{"train.ckpt_every": "2", "train.steps": "2"}).check()
    assert "done: 2 steps" in first.output
    # --resume: a run directory holding a run is only ever continued (or moved aside), never reused
    result = torchrun([LAUNCH, "--fault", "ckpt_write@1",
                       *args(tmp_path, corpus, **{"train.ckpt_every": "2", "train.steps": "4"}), "--resume"])
    error = same_error_on_both_ranks(result)
    assert "checkpoint at step 4 was not saved (writing optimizer moments" in error
    assert "Permission denied" in error
    (kept,) = list_checkpoints(tmp_path / "run")
    assert kept.name == "step_00000002"
    verify_checkpoint(kept)
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))


# ---------------------------------------------------------------- 9-10. state that must agree


def test_a_resumed_rank_whose_loader_disagrees_is_stopped_naming_it(tmp_path, corpus):
    launch(tmp_path, corpus, **{"train.steps": "3"}).check()
    result = torchrun([LAUNCH, "--fault", "loader@1", *args(tmp_path, corpus, **{"train.steps": "6"}),
                       "--resume"], timeout=120)
    assert "rank parity (after resume): loader.step differs" in same_error_on_both_ranks(result)


def test_a_weight_that_drifts_on_one_rank_is_caught_by_the_next_fingerprint_check(tmp_path, corpus):
    result = launch(tmp_path, corpus, "drift@1:2", **{"train.steps": "5"})
    error = same_error_on_both_ranks(result)
    assert re.search(r"rank parity \(step 2\): replicated\.blocks\.\d+\.mixer\.expert_bias differs", error)


# ---------------------------------------------------------------- equivalence with one process


@pytest.mark.parametrize(("strategy", "optimizer", "bound"), [
    ("fsdp", "adamw", 1e-4), ("fsdp", "muon", 2e-3), ("fsdp", "muon+qk_clip", 2e-3),
    ("fsdp", "muon+w_spectral_cap", 2e-3), ("replicate", "adamw", 1e-4), ("replicate", "muon+qk_clip", 2e-3),
    ("replicate", "muon+w_spectral_cap", 2e-3), ("hsdp", "muon+qk_clip", 2e-3)])
def test_tier3_one_rank_at_batch_4_matches_two_ranks_at_batch_2(tmp_path, corpus, strategy, optimizer, bound):
    """Tier 3: same global batch, data and initial weights. Step 1 (no update yet) agrees to 1e-5; the
    8 steps to `bound`. The ranks' gradients are averaged by a collective (a reduce-scatter under fsdp,
    an all-reduce under replicate), one process averages over the whole batch: the fp32 sums round
    differently (1e-7 relative). AdamW carries that through (measured max 2e-6); Muon's bf16
    Newton-Schulz turns it into bf16 rounding differences of the update, which grow to 8.6e-4 by step 8
    (measured under fsdp; the same order with the MoE layer removed)."""
    extra = {"train.steps": "8", "optim.use_muon": "false" if optimizer == "adamw" else "true",
             "dist.strategy": strategy}
    if strategy == "hsdp":  # 1 replica x 2 shards: the rows sharded over the second dimension of a 2-D mesh
        extra["dist.shard_size"] = "2"
    if optimizer == "muon+qk_clip":  # a tau that clips every step: row scaling of sharded QKV weights
        extra.update({"model.attention.qk_clip": "weight", "model.attention.qk_norm": "false",
                      "model.attention.qk_clip_tau": "0.5"})
    if optimizer == "muon+w_spectral_cap":  # a cap below 1 rescales R's W (FSDP2: heads sharded) every step
        extra["model.rnn.w_spectral_cap"] = "0.9"
    single = python(["-m", "megacpp.cli", *args(tmp_path / "one", corpus, **{**extra, "train.batch_size": "4"})],
                    timeout=240).check()
    assert "done: 8 steps" in single.output
    launch(tmp_path / "two", corpus, **extra).check()
    one, two = losses(tmp_path / "one" / "run"), losses(tmp_path / "two" / "run")
    assert len(one) == len(two) == 8
    assert abs(one[0] - two[0]) <= 1e-5
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) <= bound
    assert one != two, "identical to the bit would mean the two runs did not split the batch"
    if optimizer == "muon+qk_clip":
        # Step 1 clips (bound 7.8 > tau), so step 2's bound is measured on the clipped QKV rows: equal
        # bounds mean the ranks scaled their row shards as one process scales the whole matrix.
        clip = {}
        for name in ("one", "two"):
            lines = (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()
            records = [r for r in map(json.loads, lines) if r["kind"] == "train"]
            clip[name] = [(r["muon_clip/max_logit"], r["muon_clip/n_clipped"]) for r in records]
        assert clip["one"][0][1] > 0 and clip["one"][0][0] > 10 * 0.5
        for (a, _), (b, _) in zip(clip["one"][:2], clip["two"][:2], strict=True):
            assert abs(a - b) <= 1e-4 * a
    if optimizer == "muon+w_spectral_cap":
        # every rank capped its own heads: the whole W of every R block ends at sigma_max <= 0.9, to the
        # cap's slack (<= 1e-6) and fp32 rounding (1.2e-7)
        weights = load_file(str(list_checkpoints(tmp_path / "two" / "run")[0] / "model.safetensors"))
        caps = [name for name in weights if name.endswith("mixer.W")]
        assert caps
        for name in caps:
            assert torch.linalg.svdvals(weights[name].double())[..., 0].max() <= 0.9 * (1 + 2e-6), name


@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
def test_tier1_two_rank_checkpoint_resumes_on_one_and_two_ranks(tmp_path, corpus, strategy):
    """Interrupted at step 3 and resumed to 6 on 2 ranks: losses and final weights bit-identical to
    an uninterrupted 2-rank run. The step-3 checkpoint loads bit-identically (weights, moments) on 2
    ranks under either strategy and on 1 rank at the same global batch."""
    straight = tmp_path / "straight"
    launch(straight, corpus, **{"train.steps": "6", "dist.strategy": strategy}).check()
    broken = tmp_path / "broken"
    first = launch(broken, corpus, "interrupt@0:4", "interrupt@1:4", **{"train.steps": "6", "dist.strategy": strategy})
    assert first.returncode != 0 and [p.name for p in list_checkpoints(broken / "run")] == ["step_00000003"]
    for nproc, batch, other in ((2, "2", "replicate"), (2, "2", "fsdp"), (1, "4", strategy)):
        inspect = args(broken, corpus, **{"train.steps": "6", "train.batch_size": batch, "dist.strategy": other})
        result = torchrun(["tests/distributed/inspect_run.py", *inspect], nproc=nproc, timeout=120).check()
        assert result.output.count("PASS") == nproc
    torchrun([LAUNCH, *args(broken, corpus, **{"train.steps": "6", "dist.strategy": strategy}), "--resume"]).check()
    assert losses(broken / "run") == losses(straight / "run")
    a = load_file(list_checkpoints(straight / "run")[0] / "model.safetensors")
    b = load_file(list_checkpoints(broken / "run")[0] / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tier1_fsdp_run_with_bf16_moments_resumes_bitwise(tmp_path, corpus):
    """Muon's momentum and AdamW's first moments stored in bf16 (ShardedMuon and AdamW on DTensor shards),
    interrupted at step 3 and resumed to 6 on 2 ranks: losses and final weights bit-identical to an
    uninterrupted run; the checkpoint's moments are bf16 on disk."""
    bf16 = {"train.steps": "6", "dist.strategy": "fsdp", "optim.momentum_dtype": "bfloat16",
            "optim.adamw_momentum_dtype": "bfloat16"}
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    launch(straight, corpus, **bf16).check()
    first = launch(broken, corpus, "interrupt@0:4", "interrupt@1:4", **bf16)
    assert first.returncode != 0 and [p.name for p in list_checkpoints(broken / "run")] == ["step_00000003"]
    saved = FileSystemReader(list_checkpoints(broken / "run")[0] / MOMENTS_DIR).read_metadata().state_dict_metadata
    first_moments = {k: v.properties.dtype for k, v in saved.items() if k.endswith(("/momentum_buffer", "/exp_avg"))}
    assert first_moments and set(first_moments.values()) == {torch.bfloat16}, first_moments
    torchrun([LAUNCH, *args(broken, corpus, **bf16), "--resume"]).check()
    assert losses(broken / "run") == losses(straight / "run")
    a = load_file(list_checkpoints(straight / "run")[0] / "model.safetensors")
    b = load_file(list_checkpoints(broken / "run")[0] / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tier2_sharded_decoding_equals_single_process_decoding(tmp_path, corpus):
    """The end-of-run sample decoded by 2 ranks from the sharded model equals `megacpp sample` from
    the saved weights on one process (same prompt, seed and settings)."""
    launch(tmp_path, corpus, **{"train.steps": "3", "train.sample_tokens": "12", "dist.strategy": "fsdp"}).check()
    sharded = (tmp_path / "run" / "sample.txt").read_text()
    single = python(["-m", "megacpp.cli", "sample", "--checkpoint", str(tmp_path / "run"), "--tokens", "12",
                  "--prompt", "#include <", "--temperature", "0.8", "--top-k", "40", "--seed", "1337"],
                 timeout=120).check()
    assert single.output.rstrip("\n").endswith(sharded) and len(sharded) > len("#include <")


@pytest.mark.slow
def test_tier2_a_time_budget_stops_both_ranks_at_the_same_step(tmp_path, corpus):
    """The ranks agree on the budget with the step's loss (the longest clock at its last forward): a
    budget spent by the first step stops both there, with one evaluation and one checkpoint."""
    launch(tmp_path, corpus, **{"train.steps": "50", "train.time_budget_s": "0.001"}).check()
    for rank in (0, 1):
        assert "time budget of 0.001 s spent at step 1" in (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000001"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in records if r["kind"] in ("train", "val")] == [(1, "train"), (1, "val")]
