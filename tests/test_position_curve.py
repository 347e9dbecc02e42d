"""Bits per byte by position in the document (`megacpp eval --by-position`).

The reference walks each row token by token, restarting the count at every BOS (the definition), and
computes each target's NLL in float64 from the model's logits; it never calls the code under test."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megacpp.cli import main
from megacpp.config import Config
from megacpp.infer.session import load_session
from megacpp.ops import kernel_prewarm
from megacpp.runtime.evaluate import evaluate_bpb
from megacpp.runtime.generate import generate_tokens
from megacpp.runtime.position_curve import (
    bucket_bounds,
    context_positions,
    default_curve_path,
    position_curve,
    window_doc_ids,
)
from megacpp.train.loop import Trainer
from tests.helpers import tiny_train_config, write_corpus

BATCHES = 3


def test_tier1_buckets_double_from_64_up_to_the_row_length():
    assert bucket_bounds(300) == [(1, 64), (65, 128), (129, 256), (257, 300)]
    assert bucket_bounds(256) == [(1, 64), (65, 128), (129, 256)]
    assert bucket_bounds(10) == [(1, 10)]


def test_tier1_positions_restart_at_each_document():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0, 0], [5, 5, 7, 5, 5, 5, 7, 7, 7]])
    assert torch.equal(context_positions(doc_ids), torch.tensor([[1, 2, 3, 1, 2, 1, 2, 3, 4],
                                                                 [1, 2, 3, 4, 5, 6, 7, 8, 9],
                                                                 [1, 2, 1, 1, 2, 3, 1, 2, 3]]))


def test_tier1_windows_cut_each_document_into_numbered_pieces():
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 3, 3, 3], [4, 4, 4, 4, 4, 4, 4, 4]], dtype=torch.int32)
    assert torch.equal(window_doc_ids(doc_ids, 2), torch.tensor([[1, 1, 2, 2, 3, 4, 4, 5], [1, 1, 2, 2, 3, 3, 4, 4]],
                                                                dtype=torch.int32))
    assert torch.equal(window_doc_ids(doc_ids, 5), torch.tensor([[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 2, 2, 2]],
                                                                dtype=torch.int32))
    assert torch.equal(window_doc_ids(doc_ids, 8), torch.tensor([[1, 1, 1, 1, 1, 2, 2, 2], [1] * 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="context window 0: must be >= 1"):
        window_doc_ids(doc_ids, 0)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A two-step tiny run at 160 tokens per row (buckets 1-64, 65-128, 129-160), long files so that
    later buckets hold targets."""
    tmp = tmp_path_factory.mktemp("curve")
    write_corpus(tmp / "corpus", n_files=40)
    cfg = tiny_train_config(tmp, tmp / "corpus", **{"train.steps": "2", "train.ckpt_every": "2",
                                                    "data.seq_len": "160", "data.val_fraction": "0.3"})
    Trainer(cfg, log=lambda _msg: None, progress=False).run()
    return tmp / "run"


def windowed_ids(inputs: torch.Tensor, bos_id: int, window: int) -> torch.Tensor:
    """By the definition: a new piece at each row's start, at each BOS and after every `window` tokens of a
    document."""
    ids = torch.zeros_like(inputs, dtype=torch.int32)
    for r in range(inputs.shape[0]):
        piece, read = 0, 0
        for i in range(inputs.shape[1]):
            read = 1 if inputs[r, i] == bos_id or i == 0 else read + 1
            piece += (read - 1) % window == 0
            ids[r, i] = piece
    return ids


def reference_buckets(model, data, bounds, window: int | None = None) -> list[list[float]]:
    """[nats, bytes, tokens] per bucket by the definition, NLL in float64; with `window`, the model reads
    each document in pieces of that many tokens and targets keep their position in the document."""
    sums = [[0.0, 0, 0] for _ in bounds]
    for batch in data.val_batches(BATCHES):
        doc_ids = batch.doc_ids if window is None else windowed_ids(batch.inputs, data.shards.bos_id, window)
        logits = model(batch.inputs, doc_ids=doc_ids).double()
        nll = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none").view(batch.targets.shape)
        for r in range(batch.inputs.shape[0]):
            read = 0
            for i in range(batch.inputs.shape[1]):
                read = 1 if batch.inputs[r, i] == data.shards.bos_id or i == 0 else read + 1
                nbytes = int(batch.target_bytes[r, i])
                if nbytes == 0:
                    continue
                k = next(k for k, (first, last) in enumerate(bounds) if first <= read <= last)
                sums[k][0] += float(nll[r, i])
                sums[k][1] += nbytes
                sums[k][2] += 1
    return sums


def test_tier3_buckets_equal_the_definition_and_add_up_to_evaluate_bpb(run):
    """Per bucket, bytes and tokens exactly and nats within 1e-6 relative (the model's fp32 log-softmax
    against float64: ~1e-7 per token). Summed, the buckets give evaluate_bpb's figure on the same batches
    within 1e-5 relative: it sums each batch's NLL in float32 (~1e-7 x sqrt(640 tokens) of drift)."""
    session = load_session(run, Config())
    data = session.data()
    with torch.no_grad():
        curve = position_curve(session.model, data, session.device, BATCHES)
        reference = reference_buckets(session.model, data, bucket_bounds(160))
        expected_bpb = evaluate_bpb(session.model, data, session.device, BATCHES).bpb
    assert [(b.first, b.last) for b in curve.buckets] == [(1, 64), (65, 128), (129, 160)]
    assert curve.batches == BATCHES
    for bucket, (nats, nbytes, tokens) in zip(curve.buckets, reference, strict=True):
        assert (bucket.bytes, bucket.tokens) == (nbytes, tokens)
        assert math.isclose(bucket.nats, nats, rel_tol=1e-6)
    assert all(b.tokens > 0 for b in curve.buckets), "every bucket must be exercised"
    total_bytes = sum(int(b.target_bytes.sum()) for b in data.val_batches(BATCHES))
    assert sum(b.bytes for b in curve.buckets) == total_bytes
    assert math.isclose(curve.bits_per_byte, expected_bpb, rel_tol=1e-5)
    assert math.isclose(curve.bits_per_byte, math.fsum(r[0] for r in reference) / math.log(2) / total_bytes,
                        rel_tol=1e-6)


def test_tier3_a_cut_context_equals_the_definition_and_changes_only_past_the_window(run):
    """With windows of 64 tokens the buckets equal the definition's (the model fed pieces of 64 tokens, its
    targets bucketed by document position; nats within 1e-6 relative as above). Bucket 1-64 lies in the
    first window, which reads the same tokens either way (within 1e-5 relative: the rows' masks past it
    differ, so the kernels' sums may round differently); bucket 65-128 reads less, so it must differ (a
    two-step model barely uses its context: by ~2e-5 relative here)."""
    session = load_session(run, Config())
    data = session.data()
    with torch.no_grad():
        full = position_curve(session.model, data, session.device, BATCHES)
        cut = position_curve(session.model, data, session.device, BATCHES, context_window=64)
        reference = reference_buckets(session.model, data, bucket_bounds(160), window=64)
    assert cut.context_window == 64
    for bucket, (nats, nbytes, tokens) in zip(cut.buckets, reference, strict=True):
        assert (bucket.bytes, bucket.tokens) == (nbytes, tokens)
        assert math.isclose(bucket.nats, nats, rel_tol=1e-6)
    assert [(b.bytes, b.tokens) for b in cut.buckets] == [(b.bytes, b.tokens) for b in full.buckets]
    assert math.isclose(cut.buckets[0].nats, full.buckets[0].nats, rel_tol=1e-5)
    assert cut.buckets[1].nats != full.buckets[1].nats


def test_tier1_a_window_as_long_as_the_row_is_the_full_curve(run):
    """Windows of the row's length cut nothing: every bucket identical to the uncut curve."""
    session = load_session(run, Config())
    data = session.data()
    with torch.no_grad():
        full = position_curve(session.model, data, session.device, BATCHES)
        uncut = position_curve(session.model, data, session.device, BATCHES, context_window=160)
    assert uncut.buckets == full.buckets


def test_cli_context_window_writes_its_own_curve(run, capsys):
    assert main(["eval", "--checkpoint", str(run), "--batches", "1", "--by-position", "--context-window", "48"]) == 0
    out = capsys.readouterr().out
    path = default_curve_path(load_session(run, Config()).checkpoint, 48)
    assert path.name.endswith("-window48.json") and f"wrote {path}" in out
    assert "context cut to windows of 48 tokens" in out
    assert json.loads(path.read_text())["context_window"] == 48


@pytest.mark.parametrize(("argv", "message"), [
    (["--context-window", "48"], "--context-window 48: it cuts the context of --by-position's curve"),
    (["--by-position", "--context-window", "0"], "--context-window 0: must be >= 1 token"),
])
def test_context_window_misuse_is_one_line(run, capsys, argv, message):
    assert main(["eval", "--checkpoint", str(run), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_cli_eval_by_position_prints_the_table_and_writes_json(run, tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(run), "--batches", str(BATCHES), "--by-position"]) == 0
    out = capsys.readouterr().out
    checkpoint = load_session(run, Config()).checkpoint
    path = default_curve_path(checkpoint)
    assert path == run / f"position_curve-{checkpoint.name}.json" and f"wrote {path}" in out
    record = json.loads(path.read_text())
    assert [(b["first"], b["last"]) for b in record["buckets"]] == [(1, 64), (65, 128), (129, 160)]
    for b in record["buckets"]:
        assert f"{b['first']}-{b['last']}" in out and f"{b['bits_per_byte']:.4f}" in out
        assert math.isclose(b["bits_per_byte"], b["nats"] / math.log(2) / b["bytes"], rel_tol=1e-12)
    reported = float(out.split("validation bits per byte:")[1].split()[0])
    assert abs(record["bits_per_byte"] - reported) < 1e-4  # the same batches; printed with 4 decimals
    out_file = tmp_path / "curve.json"
    assert main(["eval", "--checkpoint", str(run), "--batches", "1", "--by-position", "--out", str(out_file)]) == 0
    assert json.loads(out_file.read_text())["batches"] == 1


def test_out_without_by_position_is_one_line(run, capsys):
    assert main(["eval", "--checkpoint", str(run), "--out", "x.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out x.json: only --by-position writes a file" in err


def test_tier1_evaluation_the_curve_and_generation_start_no_kernel_helpers(run, monkeypatch):
    """No backward follows these forwards, so the ops must not start helpers compiling the backward's kernels
    for their layouts (`kernel_prewarm.no_backward_follows`): every forward in them finds the prewarm off for
    a CUDA device, where a plain forward (training's) finds it on."""
    monkeypatch.delenv(kernel_prewarm.ENV_SWITCH, raising=False)
    session = load_session(run, Config())
    model, data = session.model, session.data()
    cuda = torch.device("cuda", 0)
    seen: list[tuple[str, bool]] = []
    model.register_forward_pre_hook(lambda *_: seen.append(("forward", kernel_prewarm.enabled(cuda))))
    for name in ("prefill", "forward_step"):
        original = getattr(model, name)
        monkeypatch.setattr(model, name, lambda *a, _f=original, _n=name, **k: (
            seen.append((_n, kernel_prewarm.enabled(cuda))), _f(*a, **k))[1])
    batch = next(iter(data.val_batches(1)))
    with torch.no_grad():
        model(batch.inputs, doc_ids=batch.doc_ids)
    assert seen == [("forward", True)]
    seen.clear()
    evaluate_bpb(model, data, session.device, max_batches=1)
    position_curve(model, data, session.device, 1)
    tokens = list(generate_tokens(model, [data.shards.bos_id], max_new_tokens=3, temperature=0.0, top_k=0))
    assert len(tokens) == 3 and len(seen) >= 5
    assert {name for name, _ in seen} == {"forward", "prefill", "forward_step"}
    assert not any(on for _, on in seen)
    assert kernel_prewarm.enabled(cuda)  # and on again after each
