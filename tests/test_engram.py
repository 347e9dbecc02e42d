"""Engram branch and n-gram hash embedding: loop references, document isolation, decode steps,
zero init, pinned hash values, prime table sizes and torch.compile."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch._dynamo.utils import counters

from megacpp.model.engram import WINDOWS, Engram, NgramHashEmbedding, is_prime
from megacpp.model.engram_config import EngramConfig
from megacpp.model.hints import collect_param_hints
from megacpp.model.segments import Segments, document_segments

D_MODEL, DIM, VOCAB = 16, 8, 50
FP32_TOL = 200 * torch.finfo(torch.float32).eps  # fp32 module vs float64 reference, O(1) outputs
DOC_IDS = [5, 5, 5, 7, 7, 5, 5, 5, 5, 9, 3]  # id 5 reused by a later, separate document
# hash_ids([[3, 17, 17, 42]]) with the default orders (2, 3), 2 heads, vocab 50: tables 101..109.
PINNED_IDS = [[68, 195, 284, 415], [81, 142, 211, 338], [55, 133, 309, 400], [15, 144, 226, 383]]


def rand(seed: int, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def tokens(seed: int, *shape: int) -> Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def doc_starts(doc_ids: list[int] | None, t: int) -> list[int]:
    """Index of the first token of the document holding each position."""
    starts, start = [], 0
    for i in range(t):
        if doc_ids is not None and i > 0 and doc_ids[i] != doc_ids[i - 1]:
            start = i
        starts.append(start)
    return starts


def assert_fp32_close(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=FP32_TOL, rtol=FP32_TOL)


def compile_without_breaks(fn: Callable[..., Tensor], *args: Tensor | Segments) -> Tensor:
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend="eager", fullgraph=True)(*args)
    assert not counters["graph_break"], dict(counters["graph_break"])
    return out


# ---------------------------------------------------------------- Engram

def make_engram(seed: int, gate: bool) -> Engram:
    """Engram with random mix and output projection (init has out = 0, mix uniform)."""
    torch.manual_seed(seed)
    module = Engram(D_MODEL, EngramConfig(dim=DIM, gate=gate), layer_idx=0)
    nn.init.normal_(module.out.weight, std=DIM**-0.5)
    nn.init.normal_(module.mix)
    return module


def reference_engram(module: Engram, x: Tensor, doc_ids: list[int] | None) -> Tensor:
    """Loop over positions: mean of the covered window of each order inside the document, float64."""
    b, t, _ = x.shape
    h = x.double() @ module.down.weight.double().T
    mix = module.mix.double()
    starts = doc_starts(doc_ids, t)
    mixed = torch.zeros(b, t, DIM, dtype=torch.float64)
    for i in range(t):
        for order, weight in zip(WINDOWS, mix, strict=True):
            mixed[:, i] += weight * h[:, max(starts[i], i - order + 1) : i + 1].mean(dim=1)
    if module.gate is not None:
        mixed = mixed * torch.sigmoid(x.double() @ module.gate.weight.double().T)
    return mixed @ module.out.weight.double().T


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("with_docs", [False, True])
def test_tier3_engram_matches_loop_reference(gate: bool, with_docs: bool) -> None:
    module = make_engram(1, gate)
    x = rand(2, 2, len(DOC_IDS), D_MODEL)
    doc_ids = torch.tensor([DOC_IDS] * 2) if with_docs else None
    out = module(x, document_segments(doc_ids))
    assert out.dtype == x.dtype
    assert_fp32_close(out, reference_engram(module, x, DOC_IDS if with_docs else None))


def test_tier3_engram_documents_equal_running_them_alone() -> None:
    """Breaks when positions ignore doc_ids (windows reach back across a document start)."""
    module = make_engram(3, gate=True)
    x = rand(4, 2, len(DOC_IDS), D_MODEL)
    packed = module(x, document_segments(torch.tensor([DOC_IDS] * 2)))
    starts = sorted(set(doc_starts(DOC_IDS, len(DOC_IDS))))
    for start, end in zip(starts, starts[1:] + [len(DOC_IDS)], strict=True):
        assert_fp32_close(packed[:, start:end], module(x[:, start:end]))


@pytest.mark.parametrize("gate", [False, True])
def test_tier3_engram_step_equals_forward(gate: bool) -> None:
    module = make_engram(5, gate)
    x = rand(6, 2, 7, D_MODEL)
    cache = module.init_cache(2, max_len=7, device="cpu", dtype=torch.float32)
    steps = [module.forward_step(x[:, i : i + 1], cache) for i in range(x.shape[1])]
    assert_fp32_close(torch.cat(steps, dim=1), module(x))
    assert cache["n_valid"].item() == max(WINDOWS) - 1


@pytest.mark.parametrize("gate", [False, True])
def test_tier1_engram_zero_init_outputs_zeros(gate: bool) -> None:
    module = Engram(D_MODEL, EngramConfig(dim=DIM, gate=gate), layer_idx=0)
    x = rand(7, 2, 5, D_MODEL)
    assert torch.equal(module(x, document_segments(torch.tensor([[0, 0, 1, 1, 1]] * 2))), torch.zeros_like(x))
    assert collect_param_hints(module)["mix"].optimizer == "adamw"


def test_tier1_engram_compile_fullgraph_no_breaks() -> None:
    module = make_engram(8, gate=True)
    x, segments = rand(9, 2, len(DOC_IDS), D_MODEL), document_segments(torch.tensor([DOC_IDS, sorted(DOC_IDS)]))
    assert torch.equal(compile_without_breaks(module, x, segments), module(x, segments))


# ---------------------------------------------------------------- n-gram hash embedding

def make_ngram(seed: int, **overrides) -> NgramHashEmbedding:
    """NgramHashEmbedding with a random (not zero) projection."""
    torch.manual_seed(seed)
    module = NgramHashEmbedding(VOCAB, D_MODEL, EngramConfig(ngram_dim=DIM, **overrides))
    nn.init.normal_(module.proj.weight, std=DIM**-0.5)
    return module


def reference_ids(module: NgramHashEmbedding, seq: list[int], doc_ids: list[int] | None) -> list[list[int]]:
    """Python-int hash: XOR of id * constant over the n-gram (none id before the document start),
    mod the table's prime, plus the table's row offset."""
    starts = doc_starts(doc_ids, len(seq))
    offsets = [sum(module.table_sizes[:j]) for j in range(len(module.table_sizes))]
    rows = []
    for i in range(len(seq)):
        row = []
        for j, (order, size) in enumerate(zip(module.table_orders, module.table_sizes, strict=True)):
            constants = module.multipliers[j, module.max_order - order :].tolist()
            value = 0
            for lag, constant in zip(range(order - 1, -1, -1), constants, strict=True):
                value ^= (seq[i - lag] if i - lag >= starts[i] else module.none_id) * constant
            row.append(value % size + offsets[j])
        rows.append(row)
    return rows


def test_tier1_ngram_ids_match_reference_and_are_pinned() -> None:
    module = make_ngram(10)
    seq = [3, 17, 17, 42, 0, 49, 3, 17, 8, 8, 1]
    packed = module.hash_ids(torch.tensor([seq]), document_segments(torch.tensor([DOC_IDS])))
    assert packed[0].tolist() == reference_ids(module, seq, DOC_IDS)
    # The hash is part of the checkpoint format: changing constants or layout silently remaps every row.
    assert module.table_sizes == (101, 103, 107, 109)
    assert module.hash_ids(torch.tensor([seq[:4]]))[0].tolist() == PINNED_IDS
    constants = module.multipliers
    assert torch.all((constants == 0) | ((constants % 2 == 1) & (constants < 2**31)))
    assert torch.equal(make_ngram(11).hash_ids(torch.tensor([seq])), module.hash_ids(torch.tensor([seq])))


def test_tier1_ngram_documents_hash_alone_and_packed() -> None:
    """Breaks when positions ignore doc_ids: a document's first n-grams hash the previous document's tokens."""
    module = make_ngram(12)
    seq = tokens(13, 2, len(DOC_IDS))
    packed = module.hash_ids(seq, document_segments(torch.tensor([DOC_IDS] * 2)))
    starts = sorted(set(doc_starts(DOC_IDS, len(DOC_IDS))))
    for start, end in zip(starts, starts[1:] + [len(DOC_IDS)], strict=True):
        assert torch.equal(packed[:, start:end], module.hash_ids(seq[:, start:end]))
    out = module(seq, document_segments(torch.tensor([DOC_IDS] * 2)))
    assert_fp32_close(out[:, 3:5], module(seq[:, 3:5]))


def test_tier1_ngram_meta_device_build_then_reset_hashes_the_same() -> None:
    """reset_parameters refills the hash-constant buffers, which to_empty leaves uninitialised."""
    with torch.device("meta"):
        meta_built = NgramHashEmbedding(VOCAB, D_MODEL, EngramConfig(ngram_dim=DIM))
    meta_built.to_empty(device="cpu")
    meta_built.reset_parameters()
    seq = tokens(18, 2, len(DOC_IDS))
    assert torch.equal(meta_built.hash_ids(seq), make_ngram(19).hash_ids(seq))


@pytest.mark.parametrize("orders", [[2, 3], [2], [3, 4]])
def test_tier3_ngram_step_equals_forward(orders: list[int]) -> None:
    module = make_ngram(14, ngram_orders=orders)
    seq = tokens(15, 2, 7)
    cache = module.init_cache(2, device="cpu")
    steps = [module.forward_step(seq[:, i : i + 1], cache) for i in range(seq.shape[1])]
    assert_fp32_close(torch.cat(steps, dim=1), module(seq))


@pytest.mark.parametrize("table_size", [0, 1000])
def test_ngram_table_sizes_are_distinct_primes(table_size: int) -> None:
    module = NgramHashEmbedding(VOCAB, D_MODEL, EngramConfig(ngram_heads=3, ngram_table_size=table_size))
    sizes = module.table_sizes
    assert len(sizes) == 6 and len(set(sizes)) == 6 and min(sizes) >= (table_size or 2 * VOCAB)
    assert all(all(n % p for p in range(2, n)) for n in sizes)  # brute force, independent of is_prime
    assert module.embed.num_embeddings == sum(sizes)
    assert [n for n in range(20) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19]


def test_tier1_ngram_zero_init_and_compile_fullgraph_no_breaks() -> None:
    seq, segments = tokens(16, 2, len(DOC_IDS)), document_segments(torch.tensor([DOC_IDS, sorted(DOC_IDS)]))
    fresh = NgramHashEmbedding(VOCAB, D_MODEL, EngramConfig(ngram_dim=DIM))
    assert torch.equal(fresh(seq, segments), torch.zeros(2, len(DOC_IDS), D_MODEL))
    module = make_ngram(17)
    assert torch.equal(compile_without_breaks(module, seq, segments), module(seq, segments))

