"""Segments: the document structure and attention mask computed once per forward and read by every layer.

References here are written from the definitions (a document starts at t = 0 and wherever the id
changes; attention is causal within a document), with Python loops, never with the code under test.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask

from megacpp.compile.config import CompileConfig
from megacpp.compile.health import CompileHealth, bounds_for, forbid_recompiles
from megacpp.compile.regions import compile_model
from megacpp.model import attention, segments
from megacpp.model.attention import attend
from megacpp.model.hybrid import HybridLM
from megacpp.model.segments import (
    FLEX_BLOCK_SIZE,
    Segments,
    block_mask,
    causal_document_mask_mod,
    document_segments,
    segments_of,
)
from tests.test_hybrid import randomize, shrunk

FLEX_EAGER_WARNING = ".*flex_attention called without torch.compile.*"


def random_doc_ids(b: int, t: int, seed: int) -> Tensor:
    """Several documents per row with ids drawn from a small set, so some ids are reused by later,
    non-adjacent documents (they must still count as new documents)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3, (b, t), generator=g)
    runs = torch.randint(1, 6, (b, t), generator=g)  # repeat each id a few times: documents of length > 1
    rows = [torch.repeat_interleave(ids[r], runs[r])[:t] for r in range(b)]
    return torch.stack(rows)


def reference_segments(doc_ids: Tensor, dense_mask: bool = False) -> Segments:
    """The segments of doc_ids by the definitions, one token at a time."""
    b, t = doc_ids.shape
    index = torch.zeros(b, t, dtype=torch.long)
    starts = torch.zeros(b, t, dtype=torch.long)
    for r in range(b):
        number, start = 0, 0
        for i in range(t):
            if i == 0 or doc_ids[r, i] != doc_ids[r, i - 1]:
                number, start = number + 1, i
            index[r, i], starts[r, i] = number, start
    mask = None
    if dense_mask:
        mask = torch.zeros(b, 1, t, t, dtype=torch.bool)
        for r in range(b):
            for i in range(t):
                for j in range(i + 1):
                    mask[r, 0, i, j] = bool(index[r, i] == index[r, j])
    return Segments(doc_ids, index, torch.arange(t) - starts, starts, attention_mask=mask)


def every_kind_model(seed: int, **changes) -> HybridLM:
    """Every block kind, three attention layers, Engram, the n-gram hash and two MTP heads."""
    cfg = shrunk("tiny", depth=7)
    cfg.pattern, cfg.mtp_depth, cfg.engram.layers = "AEMAFRA", 2, [1, 4]
    for name, value in changes.items():
        setattr(cfg.attention, name, value)
    torch.manual_seed(seed)
    return randomize(HybridLM(cfg), seed)


@pytest.mark.parametrize(("b", "t"), [(3, 29), (2, 64), (1, 7)])
def test_tier1_segments_match_their_definitions(b: int, t: int) -> None:
    doc_ids = random_doc_ids(b, t, seed=t)
    got = segments_of(doc_ids, t, doc_ids.device, "dense")
    want = reference_segments(doc_ids, dense_mask=True)
    assert got.doc_ids is doc_ids
    for field in ("index", "positions", "start_offsets", "attention_mask"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.flex_blocks is None
    assert bool((want.index[:, -1] >= 2).all()), "every row must hold several documents"


def test_tier1_without_documents_each_row_is_one_document() -> None:
    whole = segments_of(None, 5, torch.device("cpu"), "dense")
    assert whole.doc_ids is None and whole.index is None and whole.start_offsets is None
    assert torch.equal(whole.document_positions(5, torch.device("cpu")), torch.arange(5)[None])
    causal = torch.tensor([[j <= i for j in range(5)] for i in range(5)])[None, None]
    assert torch.equal(whole.attention_mask, causal)
    assert segments_of(None, 5, torch.device("cpu")) == Segments()


def test_tier1_forward_with_shared_segments_equals_per_layer_derivation() -> None:
    """The model's forward (segments once, shared) against a forward that hands the embeddings, every
    block and the loss their own reference segments, derived afresh per layer as each layer did before.
    Breaks if a layer reads a field that differs from its definition, or skips the shared value."""
    model = every_kind_model(seed=1)
    b, t = 3, 29
    g = torch.Generator().manual_seed(2)
    idx, targets = torch.randint(0, 97, (b, t), generator=g), torch.randint(0, 97, (b, t), generator=g)
    doc_ids = random_doc_ids(b, t, seed=3)

    def per_layer() -> Segments:
        return reference_segments(doc_ids, dense_mask=True)

    with torch.no_grad():
        shared_logits, shared_loss = model(idx, doc_ids=doc_ids), model(idx, targets, doc_ids)
        h = model.embed(idx, per_layer())
        for block in model.blocks:
            h = block(h, per_layer())
        reference_logits, reference_loss = model.logits(h), model.loss(h, targets, per_layer())
        without_documents = model(idx)
    assert torch.equal(shared_logits, reference_logits)
    assert torch.equal(shared_loss, reference_loss)
    assert not torch.equal(shared_logits, without_documents), "documents must change the output"


def test_tier1_mtp_mask_treats_a_reused_id_as_a_new_document() -> None:
    """Ids 5, 7, 5: the third document is not the first. Relabelled with distinct ids, the loss (MTP
    heads included) is the same; a same-document test on raw ids would let head k read across."""
    model = every_kind_model(seed=4)
    t = 12
    g = torch.Generator().manual_seed(5)
    idx, targets = torch.randint(0, 97, (2, t), generator=g), torch.randint(0, 97, (2, t), generator=g)
    reused = torch.tensor([[5] * 4 + [7] * 2 + [5] * 6] * 2)
    distinct = torch.tensor([[0] * 4 + [1] * 2 + [2] * 6] * 2)
    with torch.no_grad():
        assert torch.equal(model(idx, targets, reused), model(idx, targets, distinct))


def counting(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Replace module.name by a wrapper that counts its calls; returns the one-element counter."""
    calls = [0]
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.mark.parametrize(("with_documents", "softcap", "expected"), [(True, 0.0, 1), (False, 2.0, 1), (False, 0.0, 0)])
def test_dense_mask_is_built_once_per_forward(monkeypatch, with_documents: bool, softcap: float, expected: int):
    """Three attention layers, one mask per forward; none when plain causal attention needs none."""
    model = every_kind_model(seed=6, softcap=softcap)
    calls = counting(monkeypatch, segments, "causal_document_mask")
    idx = torch.randint(0, 97, (2, 16))
    doc_ids = random_doc_ids(2, 16, seed=7) if with_documents else None
    with torch.no_grad():
        for forward in range(1, 3):
            model(idx, idx, doc_ids)
            assert calls[0] == expected * forward


def test_no_mask_is_built_without_an_attention_layer(monkeypatch) -> None:
    cfg = shrunk("tiny", depth=3)
    cfg.pattern = "MFR"
    model = HybridLM(cfg)
    calls = counting(monkeypatch, segments, "causal_document_mask")
    with torch.no_grad():
        model(torch.randint(0, 97, (2, 9)), doc_ids=random_doc_ids(2, 9, seed=8))
    assert calls[0] == 0


def force_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the attention layers ask for FlexAttention on CPU (forward only: flex has no CPU backward)."""
    monkeypatch.setattr(attention, "mask_kind", lambda cfg, device, has_documents: "flex")


@pytest.mark.parametrize("with_documents", [True, False])
def test_tier3_flex_block_mask_is_built_once_per_forward_and_matches_dense(monkeypatch, with_documents: bool):
    """The block layout is built once per forward for three attention layers, and the flex forward equals
    the dense-mask forward within 1e-5 absolute: logits are soft-capped to |z| <= 15 and both are fp32
    softmax attention summed in different orders (~1e2 ulps of 15 through seven sublayers)."""
    model = every_kind_model(seed=9, softcap=2.0)
    idx = torch.randint(0, 97, (2, 37))
    doc_ids = random_doc_ids(2, 37, seed=10) if with_documents else None
    with torch.no_grad():
        dense = model(idx, doc_ids=doc_ids)
        force_flex(monkeypatch)
        calls = counting(monkeypatch, segments, "document_block_layout")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=FLEX_EAGER_WARNING)
            flex = model(idx, doc_ids=doc_ids)
    assert calls[0] == 1
    assert (flex - dense).abs().max() <= 1e-5


@pytest.mark.parametrize("seed", range(6))
def test_tier1_block_layout_equals_create_block_mask_on_random_documents(seed: int) -> None:
    """The layout read from each block's first and last document number holds the very tensors torch's
    create_block_mask finds by evaluating the mask at every token pair: random rows of documents (from
    one-token documents to whole rows), lengths below, at and past block boundaries, and no documents."""
    g = torch.Generator().manual_seed(seed)
    for t in (1, 45, FLEX_BLOCK_SIZE, FLEX_BLOCK_SIZE + 1, 3 * FLEX_BLOCK_SIZE - 7, 4 * FLEX_BLOCK_SIZE):
        b = 1 + seed % 3
        rate = (0.0, 0.002, 0.02, 0.3, 1.0, 0.01)[seed]
        starts = torch.rand(b, t, generator=g) < rate
        starts[:, 0] = True
        index = None if seed == 0 and t % 2 else starts.long().cumsum(1)
        ours = segments._flex_blocks(index, t, torch.device("cpu"))
        direct = create_block_mask(causal_document_mask_mod(index), B=None if index is None else b, H=None,
                                   Q_LEN=t, KV_LEN=t, device="cpu", BLOCK_SIZE=FLEX_BLOCK_SIZE)
        for name in ours._fields:
            assert torch.equal(getattr(ours, name), getattr(direct, name)), (t, name)


def test_tier1_block_mask_from_the_layout_equals_create_block_mask() -> None:
    """The BlockMask an attention layer wraps around the shared layout holds the very tensors
    create_block_mask returns, for an odd length over several blocks. Breaks if torch renames or
    reorders BlockMask's fields (run it on every supported torch)."""
    t = 2 * FLEX_BLOCK_SIZE + 45
    doc_ids = (torch.arange(t) * 5 // t).expand(3, t).contiguous()
    seg = segments_of(doc_ids, t, doc_ids.device, "flex")
    mask_mod = causal_document_mask_mod(reference_segments(doc_ids).index)
    direct = create_block_mask(mask_mod, B=3, H=None, Q_LEN=t, KV_LEN=t, device="cpu", BLOCK_SIZE=FLEX_BLOCK_SIZE)
    rebuilt = block_mask(seg, t)
    assert rebuilt.seq_lengths == direct.seq_lengths and rebuilt.BLOCK_SIZE == direct.BLOCK_SIZE
    for name in seg.flex_blocks._fields:
        assert torch.equal(getattr(rebuilt, name), getattr(direct, name)), name
    assert torch.equal(rebuilt.to_dense(), direct.to_dense())


def test_attend_refuses_documents_without_a_mask() -> None:
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="need the attention mask"):
        attend(q, q, q, document_segments(torch.tensor([[0, 0, 1, 1, 1]])), 0.0)


@pytest.mark.usefixtures("isolated_dynamo")
def test_flex_layout_crosses_compiled_block_regions_without_breaks_or_recompiles(monkeypatch) -> None:
    """blocks mode: the segments region returns the flex layout as tensors, every attention block wraps
    it. Zero breaks, and batches of other sizes after warmup reuse the graphs (the layout's batch axis
    is marked dynamic like x's). Forward only: FlexAttention has no CPU backward."""
    force_flex(monkeypatch)
    model = every_kind_model(seed=11)
    cfg = CompileConfig(mode="blocks", backend="eager")
    eager = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FLEX_EAGER_WARNING)
        for b in (3, 2, 4):
            idx = torch.randint(0, 97, (b, 40), generator=torch.Generator().manual_seed(b))
            eager[b] = (idx, random_doc_ids(b, 40, seed=b))
            with torch.no_grad():
                eager[b] += (model(idx, doc_ids=eager[b][1]),)
        with CompileHealth(bounds_for(cfg)) as health, torch.no_grad():
            health.attach(compile_model(model, cfg))
            for b in (3, 2, 4):
                idx, doc_ids, expected = eager[b]
                with forbid_recompiles() if b != 3 else torch.no_grad():
                    assert torch.equal(model(idx, doc_ids=doc_ids), expected)
                if b == 3:
                    health.end_warmup()
            assert health.break_sites() == {}
            assert health.totals().recompiles_after_warmup == 0
            assert health.snapshot()["HybridLM.segments"].graphs == 1


@pytest.mark.parametrize("transposed", [False, True])
def test_tier1_ordered_layout_op_agrees_with_its_fake_kernel(transposed: bool) -> None:
    """The ordering op runs opaque inside compiled regions (Inductor 2.11 could not generate its scatter at
    512 blocks), so its fake kernel must promise what it returns: shapes, dtypes and contiguous strides,
    also for the transposed (query-side) layouts. A fake that promised the input's strides made a 64K-token
    run fail Inductor's stride assertion on an H100."""
    g = torch.Generator().manual_seed(3)
    dense = torch.rand(2, 1, 37, 37, generator=g) < 0.3
    dense = dense.transpose(-2, -1) if transposed else dense
    torch.library.opcheck(torch.ops.megacpp.ordered_block_layout.default, (dense,))
    count, indices = torch.ops.megacpp.ordered_block_layout(dense)
    assert indices.is_contiguous() and count.shape == dense.shape[:-1]
    for row, (n, order) in enumerate(zip(count.flatten(0, 2), indices.flatten(0, 2), strict=True)):
        flags = dense.flatten(0, 2)[row]
        expected = torch.cat([flags.nonzero().flatten(), (~flags).nonzero().flatten()]).to(torch.int32)
        assert n.item() == int(flags.sum()) and torch.equal(order, expected)
