"""Packed loader: BOS/doc_ids, no document leakage, shifted targets, independent rows, epoch coverage,
rank sharding, exact resume, val."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megacpp.data.config import DataConfig
from megacpp.data.loader import LoaderStateError, PackedLoader, ValLoader
from megacpp.data.prepare import prepare_data
from megacpp.data.shards import ShardSet, ShardSplit

B, T = 4, 32


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    for i in range(60):
        # Every document has its own identifiers, so a token run identifies its source document.
        lines = "".join(f"    int d{i}x{j} = d{i}y{j} + {j};\n" for j in range(1 + (i * 7) % 9))
        (root / f"doc{i:02d}.cc").write_text(f"int doc{i}() {{\n{lines}    return 0;\n}}\n")
    cfg = DataConfig(
        corpus=[str(root)], val_fraction=0.25, vocab_size=512,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
    )
    return prepare_data(cfg, progress=False, log=None)


@pytest.fixture(scope="module")
def unique(tmp_path_factory):
    """Shards whose every non-BOS token is distinct, so a token names its document and position.
    Mostly short documents (a few per row) and a few long ones (several rows each)."""
    rng = np.random.default_rng(0)
    lengths = [*rng.integers(2, 20, size=300), *rng.integers(4 * T, 9 * T, size=6)]
    rng.shuffle(lengths)
    splits = {}
    next_token = 1
    for name, lens in (("train", lengths), ("val", lengths[:20])):
        docs = []
        for n in lens:
            docs.append(np.r_[0, np.arange(next_token, next_token + n - 1)])
            next_token += n - 1
        offsets = np.r_[0, np.cumsum([len(d) for d in docs])].astype(np.int64)
        splits[name] = ShardSplit(name, np.concatenate(docs).astype(np.int64), offsets,
                                  np.array([len(d) - 1 for d in docs], dtype=np.int64),
                                  [f"doc{i}" for i in range(len(docs))])
    token_bytes = np.ones(next_token, dtype=np.int32)
    token_bytes[0] = 0
    return ShardSet(tmp_path_factory.mktemp("unique"), "c" * 32, "t" * 32, 0, next_token, token_bytes, splits, True)


def where(split: ShardSplit) -> dict[int, tuple[int, int]]:
    """Non-BOS token -> (document, position in it)."""
    out = {}
    for d in range(split.num_docs):
        for at in range(1, int(split.offsets[d + 1] - split.offsets[d])):
            out[int(split.tokens[split.offsets[d] + at])] = (d, at)
    return out


def check_contiguous(split: ShardSplit, row: np.ndarray, pos: dict[int, tuple[int, int]]) -> None:
    """A row (inputs + last target) is one piece of a document stream: inside a document the positions
    follow each other, a BOS comes only right after a document's last token (or first in the row) and
    is followed by that next document's first token."""
    length = np.diff(split.offsets)
    for a, b in zip(row[:-1].tolist(), row[1:].tolist(), strict=True):
        if a and b:
            (da, pa), (db, pb) = pos[a], pos[b]
            assert da == db and pb == pa + 1, f"tokens {a} -> {b} do not follow each other in one document"
        elif a and not b:
            da, pa = pos[a]
            assert pa == length[da] - 1, f"a BOS follows token {a}, which is not its document's last"
        elif b:
            assert pos[b][1] == 1, f"after a BOS comes token {b}, not a document's first token"


def segments(inputs: torch.Tensor, doc_ids: torch.Tensor):
    """(row, first_position, tokens) for each run of equal doc id within each row."""
    for r in range(inputs.shape[0]):
        ids = doc_ids[r].numpy()
        cuts = [0, *(np.flatnonzero(np.diff(ids)) + 1).tolist(), len(ids)]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            yield r, a, inputs[r, a:b].numpy()


def locate(split, seg: np.ndarray) -> list[tuple[int, int]]:
    """Every (document, start) where seg occurs contiguously inside one manifest document."""
    hits = []
    for d in range(split.num_docs):
        doc = np.asarray(split.tokens[split.offsets[d] : split.offsets[d + 1]])
        for s in range(len(doc) - len(seg) + 1):
            if np.array_equal(doc[s : s + len(seg)], seg):
                hits.append((d, s))
    return hits


def check_no_leak(split, bos: int, inputs: torch.Tensor, doc_ids: torch.Tensor) -> None:
    """Each doc-id run must be one slice of one manifest document: a suffix (row start), whole
    documents (middle) or a prefix (row end). A run spanning two documents would hold an inner
    BOS, which no document contains, so it matches nowhere."""
    per_row = {}
    for r, start, seg in segments(inputs, doc_ids):
        per_row.setdefault(r, []).append((start, seg))
    for r, segs in per_row.items():
        assert doc_ids[r, 0] == 0
        assert torch.equal(torch.unique_consecutive(doc_ids[r]), torch.arange(len(segs), dtype=torch.int32))
        for k, (start, seg) in enumerate(segs):
            ok = [
                (d, s) for d, s in locate(split, seg)
                if (k == 0 or s == 0)  # a new doc id starts exactly at a document's BOS
                and (k == len(segs) - 1 or s + len(seg) == split.offsets[d + 1] - split.offsets[d])
            ]
            assert ok, f"row {r}: tokens {start}..{start + len(seg)} are not one slice of one document"
            assert k == 0 or seg[0] == bos


def test_bos_starts_each_document_and_doc_ids_never_leak(data):
    shards = data.shards
    loader = PackedLoader(shards, B, T, seed=1)
    for _ in range(loader.steps_per_epoch + 2):
        x, y, ids = next(loader)
        assert x.dtype == y.dtype == torch.int64 and ids.dtype == torch.int32 and x.shape == (B, T)
        assert torch.equal(ids[:, 1:] != ids[:, :-1], x[:, 1:] == shards.bos_id)
        check_no_leak(shards.splits["train"], shards.bos_id, x, ids)
    for batch in ValLoader(shards, B, T):
        check_no_leak(shards.splits["val"], shards.bos_id, batch.inputs, batch.doc_ids)


def test_targets_are_shifted_inputs(data):
    loader = PackedLoader(data.shards, B, T)
    for _ in range(3):
        x, y, _ = next(loader)
        assert torch.equal(y[:, :-1], x[:, 1:])


def test_tier1_an_epoch_reads_every_window_once_in_independent_rows(unique):
    """Each row is a contiguous piece of the epoch's document stream (documents end before a BOS and
    start after it, doc ids step exactly at BOS); over one epoch no token is a target twice and the
    only tokens left out are the dropped rows (< one global batch) and the stream's last < T tokens.
    Rows of a batch come from unrelated places: read in stream order (the old loader) every row would
    continue the row before it, and a long document would fill consecutive rows of one batch. Breaks
    if rows were read in stream order, overlapped, or crossed an epoch's end."""
    split, shards = unique.splits["train"], unique
    pos = where(split)
    lengths = np.diff(split.offsets)
    loader = PackedLoader(shards, B, T, seed=11)
    rows_per_epoch = (split.num_tokens - 1) // T
    dropped_rows = rows_per_epoch - loader.steps_per_epoch * B
    assert 0 < dropped_rows < B, "the split must leave a remainder for the rule to be tested"
    for _epoch in range(2):
        targets, continued, pairs, long_batches = [], 0, 0, {}
        for step in range(loader.steps_per_epoch):
            x, y, ids = next(loader)
            assert torch.equal(ids[:, 1:] != ids[:, :-1], x[:, 1:] == shards.bos_id)
            assert torch.equal(ids[:, 0], torch.zeros(B, dtype=torch.int32))
            for r in range(B):
                check_contiguous(split, np.r_[x[r].numpy(), y[r, -1].item()], pos)
                targets += [t for t in y[r].tolist() if t]
                first = x[r, 0].item()
                if first and lengths[pos[first][0]] > 2 * T:
                    long_batches.setdefault(pos[first][0], set()).add(step)
            for r in range(B - 1):
                pairs += 1
                continued += int(y[r, -1] == x[r + 1, 0] != shards.bos_id)
        assert len(targets) == len(set(targets)), "a token was a target twice in one epoch"
        missing = len(pos) - len(targets)
        assert 0 <= missing <= dropped_rows * T + T
        assert continued < 0.2 * pairs, f"{continued} of {pairs} adjacent rows continue each other"
        # A long document's windows land in several batches, not in one run of rows.
        assert long_batches and all(len(steps) >= 3 for steps in long_batches.values())
    assert loader.epoch == 1 and loader.step == loader.steps_per_epoch


def test_tier2_same_seed_same_batches_other_seed_other_order(unique):
    """Two loaders with one seed give the same batches bit for bit (into the second epoch); another
    seed deals other rows from the first batch on."""
    a, b = PackedLoader(unique, B, T, seed=3), PackedLoader(unique, B, T, seed=3)
    for _ in range(a.steps_per_epoch + 3):
        assert all(torch.equal(u, v) for u, v in zip(next(a), next(b), strict=True))
    other, same = PackedLoader(unique, B, T, seed=4), PackedLoader(unique, B, T, seed=3)
    assert not torch.equal(next(other).inputs, next(same).inputs)


def test_tier1_rank_sharding_partitions_the_global_batch(unique):
    """W ranks x B rows read exactly the rows of one loader of W*B, rank r the block at r*B, across an
    epoch boundary; the ranks' rows are disjoint (no token a target on two ranks)."""
    world = 2
    single = PackedLoader(unique, B * world, T, seed=3)
    ranks = [PackedLoader(unique, B, T, rank=r, world_size=world, seed=3) for r in range(world)]
    assert all(r.steps_per_epoch == single.steps_per_epoch for r in ranks)
    for _ in range(single.steps_per_epoch + 2):
        whole = next(single)
        parts = [next(r) for r in ranks]
        for i in range(3):
            assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])
        per_rank = [{t for t in p.targets.flatten().tolist() if t} for p in parts]
        assert not per_rank[0] & per_rank[1]


def test_epochs_reshuffle_document_order(data):
    loader = PackedLoader(data.shards, B, T, seed=0)
    epochs = [torch.cat([next(loader).inputs for _ in range(loader.steps_per_epoch)]) for _ in range(2)]
    assert not torch.equal(epochs[0], epochs[1])
    other_seed = PackedLoader(data.shards, B, T, seed=1)
    assert not torch.equal(next(other_seed).inputs, epochs[0][:B])


@pytest.mark.parametrize("stop", ["early", "mid_epoch", "epoch_end", "next_epoch"])
def test_tier1_resume_gives_identical_batches(data, stop):
    """A loader rebuilt from a JSON round trip of state_dict yields exactly the uninterrupted batches,
    across an epoch boundary. Breaks if the epoch shuffle drew from a global RNG, or if the state
    missed the epoch or the position within it."""
    shards = data.shards
    ref = PackedLoader(shards, B, T, seed=7)
    k = {"early": 1, "mid_epoch": ref.steps_per_epoch // 2, "epoch_end": ref.steps_per_epoch,
         "next_epoch": ref.steps_per_epoch + 2}[stop]
    n = 2 * ref.steps_per_epoch + 3  # crosses at least one epoch boundary after resuming
    expected = [next(ref) for _ in range(n)]
    first = PackedLoader(shards, B, T, seed=7)
    for _ in range(k):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = PackedLoader(shards, B, T, seed=7)
    resumed.load_state_dict(state)
    for step in range(k, n):
        got = next(resumed)
        for a, b in zip(got, expected[step], strict=True):
            assert torch.equal(a, b), f"step {step} differs after resuming at {k}"


def test_tier1_state_from_two_ranks_resumes_on_one_rank_with_the_same_global_batch(data):
    """2 ranks x B save their (identical) state mid-epoch; 1 rank x 2B loads it and reads exactly the
    rows the two ranks would have read next, in rank order. Breaks if the state records the world size
    instead of the global batch, or if the position is counted per rank."""
    shards, world = data.shards, 2
    ranks = [PackedLoader(shards, B, T, rank=r, world_size=world, seed=5) for r in range(world)]
    for _ in range(3):
        for r in ranks:
            next(r)
    states = [r.state_dict() for r in ranks]
    assert states[0] == states[1], "every rank holds the same loader state"
    single = PackedLoader(shards, B * world, T, seed=5)
    single.load_state_dict(json.loads(json.dumps(states[0])))
    for _ in range(ranks[0].steps_per_epoch + 2):  # across the epoch boundary
        whole, parts = next(single), [next(r) for r in ranks]
        for i in range(3):
            assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])


def test_another_global_batch_is_refused_unless_allowed(data):
    loader = PackedLoader(data.shards, B, T, seed=5)
    for _ in range(4):
        next(loader)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"global batch .* was 4 rows, now 8"):
        PackedLoader(data.shards, 2 * B, T, seed=5).load_state_dict(state)
    wider = PackedLoader(data.shards, 2 * B, T, seed=5)
    wider.load_state_dict(state, allow_global_batch_change=True)
    assert (wider.epoch, wider.step) == (0, 2), "the same 16 rows consumed, in steps of 8"


def test_resume_rejects_a_different_stream(data):
    state = PackedLoader(data.shards, B, T).state_dict()
    with pytest.raises(LoaderStateError, match="seq_len"):
        PackedLoader(data.shards, B, T * 2).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="global batch"):
        PackedLoader(data.shards, B * 2, T).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="data_key"):
        PackedLoader(data.shards, B, T).load_state_dict({**state, "data_key": "other"})
    # Version 2 read consecutive stream rows: the same (epoch, step) named other tokens.
    with pytest.raises(LoaderStateError, match="version 2 != 3"):
        PackedLoader(data.shards, B, T).load_state_dict({**state, "version": 2})


def test_tier2_val_loader_deterministic_with_correct_byte_counts(data):
    shards, tok = data.shards, data.tokenizer
    val = ValLoader(shards, 2, T, num_batches=3)
    assert len(val) == 3
    first, second = list(val), list(ValLoader(shards, 2, T, num_batches=3))
    assert len(first) == 3
    for a, b in zip(first, second, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    for batch in first:
        assert torch.equal(batch.target_bytes == 0, batch.targets == shards.bos_id)
        for row, nbytes in zip(batch.targets, batch.target_bytes, strict=True):
            text = tok.decode([t for t in row.tolist() if t != shards.bos_id])
            assert int(nbytes.sum()) == len(text.encode("utf-8"))  # ASCII corpus: no split chars
    # The whole split walked once covers all text bytes except the cut-off tail.
    full = ValLoader(shards, 1, T)
    split = shards.splits["val"]
    covered = sum(int(b.target_bytes.sum()) for b in full)
    tail_tokens = split.num_tokens - 1 - len(full) * T
    assert split.num_bytes - covered <= tail_tokens * int(shards.token_bytes.max())
    assert covered <= split.num_bytes


def test_tier1_a_small_val_split_is_evaluated_whole_on_any_rank_count(data):
    """More rows asked for than the split holds (and a last batch that is not full): every row once,
    over 1, 2 and 3 ranks, each rank the same number of batches, padding rows counting no bytes.
    Breaks if the loader clamps to whole global batches (a small split would then fail or lose rows)."""
    shards, T2 = data.shards, 2 * T
    alone = ValLoader(shards, 4, T2, num_batches=1000)
    total_rows = alone.num_rows
    # The split must not fill whole batches on any rank count, or the test would mean nothing.
    assert total_rows % 4 and total_rows % 8 and total_rows % 12
    expected = sum(int(b.target_bytes.sum()) for b in alone)
    real_rows = torch.cat([b.inputs[b.target_bytes.sum(dim=1) > 0] for b in alone])
    for world in (2, 3):
        ranks = [ValLoader(shards, 4, T2, num_batches=1000, rank=r, world_size=world) for r in range(world)]
        assert len({len(r) for r in ranks}) == 1
        # Every batch of every rank has batch_size rows, a rank past the split's end too: a forward with
        # collectives in it (expert parallelism's all-to-all) needs the same shapes on every rank.
        assert {tuple(b.inputs.shape) for r in ranks for b in r} == {(4, T2)}
        assert sum(int(b.target_bytes.sum()) for r in ranks for b in r) == expected
        rows = torch.cat([b.inputs[b.target_bytes.sum(dim=1) > 0] for r in ranks for b in r])
        assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, real_rows.tolist()))


def test_split_too_small_error(data):
    with pytest.raises(ValueError, match="val split has .* tokens: one row needs"):
        ValLoader(data.shards, 2, 1_000_000)
    with pytest.raises(ValueError, match="rank 2 not in"):
        PackedLoader(data.shards, B, T, rank=2, world_size=2)
