"""Per-part and per-block gradient norms (megacpp.train.grad_norms): they partition the global norm, name
the part and the block a planted spike comes from, change nothing, and land in every training record."""
import math

import torch

from megacpp.distributed.context import DistContext
from megacpp.model.hybrid import HybridLM
from megacpp.model.params import parameter_parts
from megacpp.model.registry import BLOCK_KINDS
from megacpp.presets import tiny
from megacpp.train.grad_norms import NormHistory, PartGradNorms, spike_summary, topmost_inflated_block
from megacpp.train.loop import Trainer
from megacpp.train.metrics import read_metrics
from tests.helpers import tiny_train_config


def _model_with_grads(seed: int = 0) -> HybridLM:
    cfg = tiny().model
    cfg.vocab_size = 300
    torch.manual_seed(seed)
    model = HybridLM(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 37))
    doc_ids = torch.cat([torch.zeros(2, 20, dtype=torch.long), torch.ones(2, 17, dtype=torch.long)], dim=1)
    model(idx, torch.roll(idx, -1, dims=1), doc_ids).backward()
    return model


def test_tier1_parts_cover_every_parameter_exactly_once():
    model = _model_with_grads()
    listed = [p for _, params in parameter_parts(model) for p in params]
    assert len(listed) == len({id(p) for p in listed})
    assert {id(p) for p in listed} == {id(p) for p in model.parameters()}
    assert [name for name, _ in parameter_parts(model)][:len(BLOCK_KINDS)] == list(BLOCK_KINDS)


def test_tier3_parts_compose_the_global_norm():
    """sqrt(sum of the parts' squares) against clip_grad_norm_'s total: both are fp32 sums of the same
    4.5M squares in different orders, each within ~log2(n) * 2^-24 = 1.4e-6 relative of the exact sum;
    rtol 1e-5 leaves room and still fails on any missing or doubled part (the smallest part, the head
    norm, is > 1e-3 of the total here)."""
    model = _model_with_grads()
    norms, _ = PartGradNorms(model, DistContext()).measure()
    total = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1e9)
    composed = math.sqrt(sum(float(v) ** 2 for v in norms.values()))
    assert math.isclose(composed, float(total), rel_tol=1e-5, abs_tol=0.0)
    assert min(float(v) for v in norms.values()) > 1e-3 * float(total)


def test_tier3_blocks_compose_their_parameters_norm():
    """Each block's norm against clip_grad_norm_ over that block's parameters alone (same fp32 bound as
    above); the labels follow the pattern."""
    model = _model_with_grads()
    measure = PartGradNorms(model, DistContext())
    _, blocks = measure.measure()
    assert measure.block_labels == [f"{i}{kind}" for i, kind in enumerate("AEMFRAEMFR")]
    for block, norm in zip(model.blocks, blocks.tolist(), strict=True):
        expected = torch.nn.utils.clip_grad_norm_([p for p in block.parameters() if p.grad is not None], 1e9)
        assert math.isclose(norm, float(expected), rel_tol=1e-5, abs_tol=0.0)


def test_tier1_a_planted_spike_is_named_and_the_other_parts_do_not_move():
    model = _model_with_grads()
    before, blocks_before = PartGradNorms(model, DistContext()).measure()
    mamba = [p for p in model.blocks[7].mixer.parameters() if p.grad is not None]
    max(mamba, key=lambda p: float(p.grad.norm())).grad.mul_(1e4)
    measure = PartGradNorms(model, DistContext())
    after, blocks_after = measure.measure()
    assert float(after["grad_norm_M"]) > 100 * float(before["grad_norm_M"])
    assert max(after, key=lambda k: float(after[k])) == "grad_norm_M"
    assert all(torch.equal(after[k], before[k]) for k in before if k != "grad_norm_M")
    assert float(blocks_after[7]) > 100 * float(blocks_before[7])
    assert all(torch.equal(blocks_after[i], blocks_before[i]) for i in range(len(model.blocks)) if i != 7)
    typical = measure.block_record(blocks_before)
    assert topmost_inflated_block(measure.block_record(blocks_after), typical) == "7M"


def test_tier1_the_topmost_inflated_block_is_the_deepest_over_the_factor():
    """A blow-up in the backward at depth k inflates k and everything below it: the answer is the
    deepest block over factor x typical, not the largest one, and None when nothing is inflated."""
    typical = {"0A": 1.0, "1M": 1.0, "2R": 1.0, "10E": 1.0, "11M": 1.0}
    spike = {"0A": 500.0, "1M": 900.0, "2R": 20.0, "10E": 9.0, "11M": 0.5}
    assert topmost_inflated_block(spike, typical) == "2R"
    assert topmost_inflated_block(spike, typical, factor=50.0) == "1M"
    assert topmost_inflated_block({**spike, "10E": 11.0}, typical) == "10E"  # depth 10 above depth 2
    assert topmost_inflated_block(typical, typical) is None


def test_tier1_training_logs_every_part_and_its_losses_do_not_depend_on_it(tmp_path, small_corpus, monkeypatch):
    """Measuring reads the gradients only: a run with the measurement replaced by nothing has the same
    losses bit for bit; every training record has one norm per part."""
    measured = Trainer(tiny_train_config(tmp_path / "a", small_corpus), log=lambda _m: None, progress=False)
    measured.run()
    monkeypatch.setattr(PartGradNorms, "measure", lambda self: ({}, torch.zeros(len(self.block_labels))))
    unmeasured = Trainer(tiny_train_config(tmp_path / "b", small_corpus), log=lambda _m: None, progress=False)
    unmeasured.run()
    assert measured.losses == unmeasured.losses
    parts = {f"grad_norm_{name}" for name, _ in parameter_parts(measured.model)}
    records = [r for r in read_metrics(tmp_path / "a" / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert records and all(parts <= r.keys() and all(r[k] > 0 for k in parts) for r in records)
    labels = [f"{i}{block.kind}" for i, block in enumerate(measured.model.blocks)]
    assert all(list(r["block_grad_norms"]) == labels and min(r["block_grad_norms"].values()) > 0 for r in records)


def _history(spike_step: int | None, with_blocks: bool = True, steps: int = 40) -> NormHistory:
    """`steps` steps at norm 1 (steps 1-20 at 30: early steps are not spikes), blocks 0A 1M 2R at 1; at
    spike_step the norm is 50 and blocks 0A and 1M are at 40 (the blow-up starts at 1M)."""
    history = NormHistory()
    for step in range(1, steps + 1):
        norm, blocks = (30.0 if step <= 20 else 1.0), {"0A": 1.0, "1M": 1.0, "2R": 1.0}
        if step == spike_step:
            norm, blocks = 50.0, {"0A": 40.0, "1M": 40.0, "2R": 1.0}
        history.append(step, norm, blocks if with_blocks else None)
    return history


def test_tier1_the_end_of_run_line_counts_spikes_and_names_where_they_start():
    line = spike_summary(_history(30))
    assert line.startswith("gradient norm: 1 of 20 steps after step 20 above 10x the median 1 "
                           "(largest 50 at step 30, before clipping); they start at 1M (1) (")
    assert "they start" not in spike_summary(_history(30, with_blocks=False))
    partial = _history(30)
    partial.append(41, 1.0, None)  # one step without block norms: no block is named from a partial window
    assert "they start" not in spike_summary(partial) and "1 of 21 steps" in spike_summary(partial)
    assert spike_summary(_history(None)) is None  # steps 1-20 at 30x the later median are not spikes
    assert spike_summary(_history(None, steps=22)) is None  # too few steps after the quiet start


def test_tier1_the_run_summary_prints_the_spike_line(tmp_path):
    from megacpp.data.baselines import Baselines
    from megacpp.runtime.evaluate import Evaluation
    from megacpp.train.report import TrainResult, run_summary

    baselines = Baselines(unigram_bpb=2.0, xz_bpb=0.9, xz_given_train_bpb=0.6, val_bytes=1000, context_bytes=10,
                          train_bytes=10)
    line = spike_summary(_history(30))
    evaluation = Evaluation(1.5, tokens=400, bytes=1000, split_tokens=400, whole=True)
    result = TrainResult(tmp_path, 40, [], evaluation, baselines, tmp_path / "ckpt", "", grad_spikes=line)
    assert line in run_summary(result).splitlines()
    assert "gradient norm" not in run_summary(TrainResult(tmp_path, 40, [], evaluation, baselines, None, ""))
