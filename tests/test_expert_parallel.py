"""Expert parallelism (``dist.expert_parallel``) under torchrun: gloo, 2 CPU ranks, each launch under a
wall-clock limit so that a hang fails its test instead of stalling CI. `tiny` at toy width has one E
block of 4 experts (top 2): with EP = 2 each rank holds 2 of them and the tokens travel by all-to-all.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megacpp.distributed.expert_parallel import send_layout
from megacpp.runtime.checkpoint import list_checkpoints
from tests.helpers import write_corpus
from tests.test_dist_train import LAUNCH, args, launch, losses, same_error_on_both_ranks
from tests.torchrun import python, torchrun

EP = {"dist.expert_parallel": "2"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep") / "corpus"
    write_corpus(root)
    return root


@pytest.mark.parametrize(("b", "m", "n_experts", "degree"), [(3, 17, 4, 2), (2, 64, 8, 4), (1, 5, 8, 8), (4, 33, 6, 3)])
def test_tier1_send_layout_puts_every_row_once_in_its_experts_rank_chunk_in_expert_order(b, m, n_experts, degree):
    routed = torch.randint(0, n_experts, (b, m), generator=torch.Generator().manual_seed(b * m + degree))
    source, slot, used, counts = send_layout(routed, n_experts, degree)
    n, flat = b * m, routed.reshape(-1)
    assert torch.equal(counts, torch.bincount(flat, minlength=n_experts))
    assert torch.equal(source[slot], torch.arange(n)), "each row's slot holds that row"
    assert int(used.sum()) == n and bool(used[slot].all()), "exactly the rows' slots are used"
    assert torch.equal(slot // n, flat // (n_experts // degree)), "in the chunk of its expert's rank"
    for rank in range(degree):  # a chunk's used slots come first and hold its rows in stable expert order
        chunk_used = used[rank * n:(rank + 1) * n]
        rows = source[rank * n:(rank + 1) * n][chunk_used]
        assert torch.equal(chunk_used, torch.arange(n) < len(rows))
        mine = torch.nonzero(flat // (n_experts // degree) == rank).squeeze(1)
        assert torch.equal(rows, mine[torch.argsort(flat[mine], stable=True)])


@pytest.mark.slow
def test_tier3_two_expert_parallel_ranks_match_one_rank_and_replicate(tmp_path, corpus):
    """Same global batch (4 rows), data and initial weights, 8 steps. Against one process the bound is
    the replicate test's (tests/test_dist_train.py): the ranks' gradients are summed in another order,
    and Muon's bf16 Newton-Schulz turns fp32 rounding into bf16 rounding (measured max 1.0e-3 here).
    Against 2 ranks without EP only the expert rows move differently (an all-to-all instead of a
    reduction of the expert gradients, so their fp32 sums run in another order): identical over these 8
    steps on one CPU; on an AVX-512 one identical through step 5, then the first rounding difference grew
    about 10x a step under Muon (loss 4.8e-6 apart at step 6, 6.6e-5 at step 8; the E norm 1.4e-5 relative
    at step 6, 9.6e-4 at step 8). So the first 5 steps are held to rounding and all 8 to 1e-3, the size the
    same amplification reaches against one process."""
    extra = {"train.steps": "8"}
    single = python(["-m", "megacpp.cli", *args(tmp_path / "one", corpus, **extra, **{"train.batch_size": "4"})])
    single.check()
    result = launch(tmp_path / "ep", corpus, **extra, **EP).check()
    assert "expert parallelism 2 x 1 replica(s): this rank holds experts 0..1 of each E block" in result.output
    launch(tmp_path / "rep", corpus, **extra, **{"dist.strategy": "replicate"}).check()
    one, ep, rep = (losses(tmp_path / name / "run") for name in ("one", "ep", "rep"))
    assert len(one) == len(ep) == len(rep) == 8
    assert abs(one[0] - ep[0]) <= 1e-5
    assert max(abs(a - b) for a, b in zip(one, ep, strict=True)) <= 2e-3
    assert max(abs(a - b) for a, b in zip(rep[:5], ep[:5], strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(rep, ep, strict=True)) <= 1e-3
    # The clip's global norm and the E part's and E block's norms add the expert squares over the expert
    # group: the figures 2 ranks without EP log, to fp32 summation order (measured 2e-7 relative) while the
    # weights agree to rounding (the first 5 steps; a missing or doubled square would be off at step 1).
    records = {name: [r for r in map(json.loads, (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines())
                      if r["kind"] == "train"] for name in ("ep", "rep")}
    assert len(records["ep"]) == len(records["rep"]) == 8
    for a, b in zip(records["ep"][:5], records["rep"][:5], strict=True):
        for value_a, value_b in ((a["grad_norm"], b["grad_norm"]), (a["grad_norm_E"], b["grad_norm_E"]),
                                 (a["block_grad_norms"]["1E"], b["block_grad_norms"]["1E"])):
            assert abs(value_a - value_b) <= 1e-5 * value_b
    # The header counts the whole model, not this rank's half of the experts: 4 x (32 x 32) x 2 + router
    # 128 + shared expert 2 x 1024 + norm 32.
    assert "E mixture-of-experts FFN         1        10,400" in result.output
    # and so does the optimizers' group table (its total line as 2 ranks without EP print it)
    rep_output = (tmp_path / "rep" / "run" / "logs" / "rank0.log").read_text()
    total = next(line for line in rep_output.splitlines() if line.startswith("total "))
    assert total in result.output


@pytest.mark.slow
def test_tier3_expert_parallelism_beside_fsdp_matches_one_rank_and_replicate(tmp_path, corpus):
    """dist.strategy fsdp shards every parameter but the expert rows (FSDP2's ignored parameters): the
    same 8 steps against one process (measured 1.6e-3 apart: fsdp's reduce-scatter and Muon's bf16
    rounding, as in tests/test_dist_train.py) and against EP beside replicate (5.5e-4); the clip's norm
    adds the fsdp shards' and the expert rows' squares alike (measured 1e-7 relative)."""
    extra = {"train.steps": "8"}
    python(["-m", "megacpp.cli", *args(tmp_path / "one", corpus, **extra, **{"train.batch_size": "4"})]).check()
    result = launch(tmp_path / "fsdp", corpus, **EP, **extra, **{"dist.strategy": "fsdp"}).check()
    assert "data parallelism: fsdp (dist.strategy); expert parallelism 2 x 1 replica(s)" in result.output
    launch(tmp_path / "rep", corpus, **EP, **extra).check()
    one, fsdp, rep = (losses(tmp_path / name / "run") for name in ("one", "fsdp", "rep"))
    assert max(abs(a - b) for a, b in zip(one, fsdp, strict=True)) <= 2e-3
    assert max(abs(a - b) for a, b in zip(rep, fsdp, strict=True)) <= 2e-3
    norms = {name: [r["grad_norm"] for r in map(json.loads, (tmp_path / name / "run" / "metrics.jsonl")
                                                 .read_text().splitlines()) if r["kind"] == "train"]
             for name in ("fsdp", "rep")}
    assert abs(norms["fsdp"][0] - norms["rep"][0]) <= 1e-5 * norms["rep"][0]  # step 1: the same gradients


@pytest.mark.slow
def test_tier3_expert_parallelism_over_two_replicas_matches_four_replicate_ranks(tmp_path, corpus):
    """4 ranks as EP 2 x 2 replicas (the expert gradients also all-reduced over the replicas) against 4
    replicate ranks, 1 row each, 6 steps: measured 9.5e-7 apart, bounded at 1e-4."""
    extra = {"train.steps": "6", "train.batch_size": "1"}
    result = launch(tmp_path / "ep", corpus, nproc=4, timeout=300, **EP, **extra).check()
    assert "expert parallelism 2 x 2 replica(s)" in result.output
    launch(tmp_path / "rep", corpus, nproc=4, timeout=300, **extra).check()
    ep, rep = losses(tmp_path / "ep" / "run"), losses(tmp_path / "rep" / "run")
    assert len(ep) == len(rep) == 6 and ep[0] == rep[0]
    assert max(abs(a - b) for a, b in zip(ep, rep, strict=True)) <= 1e-4


@pytest.mark.slow
def test_tier3_eight_ranks_as_ep4_over_two_replicas_match_eight_replicate_ranks(tmp_path, corpus):
    """The layout of MegaCpp's NAM56R on a node of 8 GPUs (EP 4 x 2 replicas), as 8 gloo ranks: each rank holds one
    of the block's 4 experts and the expert gradients are all-reduced over the replicas, against 8 replicate ranks,
    1 row each, 4 steps: the first step's loss the same, then measured 1.0e-5 apart, bounded at 1e-4 as at 4 ranks."""
    extra = {"train.steps": "4", "train.batch_size": "1"}
    result = launch(tmp_path / "ep", corpus, nproc=8, timeout=420, **extra, **{"dist.expert_parallel": "4"}).check()
    assert "expert parallelism 4 x 2 replica(s)" in result.output
    launch(tmp_path / "rep", corpus, nproc=8, timeout=420, **extra).check()
    ep, rep = losses(tmp_path / "ep" / "run"), losses(tmp_path / "rep" / "run")
    assert len(ep) == len(rep) == 4 and ep[0] == rep[0]
    assert max(abs(a - b) for a, b in zip(ep, rep, strict=True)) <= 1e-4


@pytest.mark.slow
def test_tier3_every_token_routed_to_one_ranks_experts_runs_and_matches_one_rank(tmp_path, corpus):
    """A skewed router (test-only: selection biases +100 on experts 0 and 1, both on rank 0) sends every
    routed row to rank 0; the dropless buffers take them all, so EP still matches one process."""
    extra = {"train.steps": "8", "train.ckpt_every": "8"}
    single = python([LAUNCH, "--fault", "skew@0",
                     *args(tmp_path / "one", corpus, **extra, **{"train.batch_size": "4"})])
    single.check()
    torchrun([LAUNCH, "--fault", "skew@0", "--fault", "skew@1", *args(tmp_path / "ep", corpus, **extra, **EP)]).check()
    one, ep = losses(tmp_path / "one" / "run"), losses(tmp_path / "ep" / "run")
    assert max(abs(a - b) for a, b in zip(one, ep, strict=True)) <= 2e-3
    weights = load_file(list_checkpoints(tmp_path / "ep" / "run")[0] / "model.safetensors")
    bias = next(v for k, v in weights.items() if k.endswith("expert_bias"))
    # Every step experts 0 and 1 took every token (load above the mean: bias down by the rate), 2 and 3
    # none (up by it): 8 steps of 1e-3.
    assert torch.equal(bias > 99, torch.tensor([True, True, False, False]))
    assert (bias[2:] > 0).all() and (bias[:2] < 100).all()


@pytest.mark.slow
def test_expert_parallel_ranks_evaluate_the_whole_split_when_one_rank_runs_past_its_end(tmp_path, corpus):
    """At val_fraction 0.3 the split's last global batch leaves rank 1 no real row: it must still run a
    batch of the same shape, or its E blocks' all-to-all waits for a peer that has finished (it hung)."""
    result = launch(tmp_path, corpus, timeout=120, **EP, **{
        "train.steps": "3", "train.eval_every": "3", "train.eval_batches": "0", "data.val_fraction": "0.3"})
    assert "over 3,637 tokens (the whole validation split)" in result.check().output


@pytest.fixture(scope="module", params=["replicate", "fsdp"])
def compiled_ep_run(request, tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp(f"compiled-ep-{request.param}")
    result = launch(tmp, corpus, timeout=500, **EP, **{
        "compile.mode": "blocks", "compile.backend": "aot_eager", "compile.forbid_recompiles": "true",
        "train.steps": "4", "train.ckpt_every": "4", "dist.strategy": request.param})
    return tmp / "run", result


@pytest.mark.slow
def test_expert_parallel_blocks_compile_with_zero_breaks_and_equal_graphs_on_both_ranks(compiled_ep_run):
    """The all-to-alls are functional collectives traced into the E block's graph: no break around them."""
    run_dir, result = compiled_ep_run
    result.check()
    record = next(r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                  if r["kind"] == "compile")
    assert record["graph_break_sites"] == 0 and record["recompiles_after_warmup"] == 0
    assert record["graphs_per_rank"][0] == record["graphs_per_rank"][1] > 0


@pytest.mark.slow
def test_tier3_routed_experts_on_adamw_under_expert_parallelism_match_one_rank_and_reload(tmp_path, corpus):
    """`optim.expert_optimizer adamw` with EP = 2: each rank steps its own experts' AdamW moments. 8 steps
    agree with one process at the same global batch to the Muon bound above (the other matrices stay on
    Muon), the group table counts the whole experts under AdamW, and the step-8 checkpoint (whole expert
    moments) loads bit-identically with EP = 2 and on one rank."""
    extra = {"train.steps": "8", "optim.expert_optimizer": "adamw"}
    single = python(["-m", "megacpp.cli", *args(tmp_path / "one", corpus, **extra, **{"train.batch_size": "4"})])
    assert "adamw:hidden                   2         8,192" in single.check().output
    result = launch(tmp_path / "ep", corpus, **extra, **EP).check()
    assert "adamw:hidden                   2         8,192" in result.output, "both ranks' experts, counted whole"
    one, ep = losses(tmp_path / "one" / "run"), losses(tmp_path / "ep" / "run")
    assert len(one) == len(ep) == 8
    assert abs(one[0] - ep[0]) <= 1e-5
    assert max(abs(a - b) for a, b in zip(one, ep, strict=True)) <= 2e-3
    for nproc, batch, degree in ((2, "2", "2"), (1, "4", "1")):
        inspect = args(tmp_path / "ep", corpus, **extra, **{"train.batch_size": batch, "dist.expert_parallel": degree})
        result = torchrun(["tests/distributed/inspect_run.py", *inspect], nproc=nproc, timeout=120).check()
        assert result.output.count("PASS") == nproc


@pytest.mark.slow
def test_tier1_an_expert_parallel_checkpoint_resumes_bitwise_and_loads_in_every_layout(tmp_path, corpus):
    """Interrupted at step 4 and resumed to 6 with EP = 2: losses and weights bit-identical to an
    uninterrupted run. The step-3 checkpoint holds whole expert tensors and loads bit-identically
    (weights and moments) with EP = 2 beside replicate and beside fsdp, on 2 ranks without EP and on 1
    rank; a checkpoint written without EP loads with EP = 2."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    launch(straight, corpus, **EP, **{"train.steps": "6"}).check()
    first = launch(broken, corpus, "interrupt@0:4", "interrupt@1:4", **EP, **{"train.steps": "6"})
    assert first.returncode != 0 and [p.name for p in list_checkpoints(broken / "run")] == ["step_00000003"]
    saved = load_file(list_checkpoints(broken / "run")[0] / "model.safetensors")
    assert saved["blocks.1.mixer.w_up"].shape == (4, 32, 32), "the whole experts, in the one format"
    for nproc, batch, degree, strategy in ((2, "2", "2", "replicate"), (2, "2", "2", "fsdp"), (2, "2", "1", "auto"),
                                           (1, "4", "1", "auto")):
        inspect = args(broken, corpus, **{"train.steps": "6", "train.batch_size": batch,
                                          "dist.expert_parallel": degree, "dist.strategy": strategy})
        result = torchrun(["tests/distributed/inspect_run.py", *inspect], nproc=nproc, timeout=120).check()
        assert result.output.count("PASS") == nproc
    torchrun([LAUNCH, *args(broken, corpus, **EP, **{"train.steps": "6"}), "--resume"]).check()
    assert losses(broken / "run") == losses(straight / "run")
    a = load_file(list_checkpoints(straight / "run")[0] / "model.safetensors")
    b = load_file(list_checkpoints(broken / "run")[0] / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plain = tmp_path / "plain"
    launch(plain, corpus, **{"train.steps": "3"}).check()
    inspect = args(plain, corpus, **EP, **{"train.steps": "3"})
    assert torchrun(["tests/distributed/inspect_run.py", *inspect], timeout=120).check().output.count("PASS") == 2


@pytest.mark.slow
def test_an_expert_parallel_degree_that_differs_on_one_rank_stops_both_within_seconds(tmp_path, corpus):
    result = launch(tmp_path, corpus, "expert_parallel@1", timeout=120, **EP)
    error = same_error_on_both_ranks(result)
    assert "expert_parallel differs" in error
    assert result.seconds < 60
    assert not list_checkpoints(tmp_path / "run")


@pytest.mark.slow
def test_a_router_gone_nonfinite_on_one_rank_stops_every_rank_with_one_line(tmp_path, corpus):
    result = launch(tmp_path, corpus, "router_nan@1:2", timeout=120, **EP, **{"train.steps": "6"})
    error = same_error_on_both_ranks(result)
    assert "loss is nan on rank(s) 1; rank 1: first non-finite output at sublayer 1 (E: MoE)" in error
    # torchrun's own agent prints a traceback for any failed worker; the ranks print none.
    assert not [line for line in result.output.splitlines() if line.startswith("[default") and "Traceback" in line]
    assert result.seconds < 90


def test_expert_parallelism_on_one_process_is_refused_in_one_line(tmp_path, corpus):
    result = python(["-m", "megacpp.cli", *args(tmp_path, corpus, **EP, **{"train.steps": "2"})], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.output
    assert ("megacpp: config error: dist.expert_parallel = 2 does not divide the 1 rank(s) of this job (launch "
            "torchrun with a multiple of 2 processes)") in result.output


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "named"), [
    ({"dist.expert_parallel": "3"}, "does not divide the 2 rank(s) of this job"),
    ({"model.moe.n_experts": "3"}, "does not divide blocks.1.mixer's 3 experts"),
])
def test_an_expert_parallel_setting_that_cannot_work_is_one_line_on_both_ranks(tmp_path, corpus, overrides, named):
    result = launch(tmp_path, corpus, timeout=120, **{**EP, **overrides})
    assert named in same_error_on_both_ranks(result)
