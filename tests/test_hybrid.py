"""Whole-model tests: decode caches, packed-document isolation, compile, parameter table, MTP."""
from collections import Counter

import pytest
import torch
import torch._dynamo

from megacpp.model.config import ModelConfig
from megacpp.model.hybrid import HybridLM
from megacpp.model.params import parameter_rows, parameter_table
from megacpp.presets import PRESETS, preset

# fp32 end to end through ~5-12 sublayers: 1e-4 absolute on logits of magnitude <= 15 (the soft cap)
# is ~1e3 ulps of float32 relative error, room for the different summation orders of chunked scans
# vs recurrent steps, and far below any real bug (wrong masking shifts logits by >= 1e-2).
LOGIT_ATOL = 1e-4


def shrunk(name: str, depth: int | None = None) -> ModelConfig:
    """The preset's block mix at test size; MoE capacity ample so nothing overflows."""
    cfg = preset(name).model
    cfg.vocab_size, cfg.d_model = 97, 64
    cfg.depth = depth or len(cfg.pattern)
    cfg.attention.n_heads, cfg.attention.n_kv_heads, cfg.attention.head_dim = 4, 2, 16
    cfg.mamba.d_state, cfg.mamba.head_dim, cfg.mamba.chunk_size = 8, 16, 8
    cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.expert_hidden, cfg.moe.capacity_factor = 4, 2, 32, 8.0
    cfg.rnn.n_heads, cfg.rnn.key_dim, cfg.rnn.value_dim = 2, 16, 16
    cfg.ffn.hidden = 128
    cfg.engram.dim = 16
    cfg.engram.layers = [i for i in cfg.engram.layers if i < cfg.depth] or [1]
    cfg.engram.ngram_hash = True
    return cfg


def randomize(model: HybridLM, seed: int = 0) -> HybridLM:
    """Zero-initialised output projections hide bugs in the branches they gate: fill every parameter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 / max(p.shape[-1], 1) ** 0.25)
    return model


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_tier3_atol_1e4_decode_matches_forward(name):
    """forward_step token by token == full forward, for every preset's block mix.
    Breaks if any layer's cache (KV, Mamba state, RNN state, Engram window, n-gram history) is wrong."""
    torch.manual_seed(0)
    model = randomize(HybridLM(shrunk(name))).eval()
    idx = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        full = model(idx)
        cache = model.init_cache(batch_size=2, max_len=13)
        steps = torch.cat([model.forward_step(idx[:, i : i + 1], cache) for i in range(13)], dim=1)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() <= LOGIT_ATOL


def test_tier3_atol_1e4_packed_documents_isolated():
    """Each document's logits are the same alone or packed with others (every block kind, Engram and
    the n-gram hash on, MoE with ample capacity). Breaks if any mixer leaks across a boundary."""
    torch.manual_seed(1)
    model = randomize(HybridLM(shrunk("tiny", depth=10)), seed=1).eval()
    lengths = [5, 11, 1, 8]
    docs = [torch.randint(0, 97, (n,)) for n in lengths]
    packed = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        together = model(packed, doc_ids=doc_ids)[0]
        start = 0
        for doc in docs:
            alone = model(doc[None])[0]
            diff = (together[start : start + len(doc)] - alone).abs().max().item()
            assert diff <= LOGIT_ATOL, f"document at {start} differs by {diff}"
            start += len(doc)


def test_tier3_doc_ids_change_the_output():
    """Guards the isolation test: without doc_ids the packed row must differ (else it proves nothing)."""
    model = randomize(HybridLM(shrunk("tiny", depth=10)), seed=2).eval()
    idx = torch.randint(0, 97, (1, 12))
    doc_ids = torch.tensor([[0] * 6 + [1] * 6])
    with torch.no_grad():
        assert (model(idx)[0, 6:] - model(idx, doc_ids=doc_ids)[0, 6:]).abs().max() > 1e-3


def test_loss_and_ignore_index_and_mtp():
    cfg = shrunk("tiny", depth=5)
    cfg.mtp_depth = 2
    model = randomize(HybridLM(cfg))
    idx = torch.randint(0, 97, (2, 9))
    targets = torch.randint(0, 97, (2, 9))
    loss = model(idx, targets)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.mtp.parameters())
    all_ignored = torch.full_like(targets, -1)
    all_ignored[:, 0] = targets[:, 0]
    cfg_no_mtp = shrunk("tiny", depth=5)
    plain = randomize(HybridLM(cfg_no_mtp))
    assert torch.isfinite(plain(idx, all_ignored))


def test_parameter_table_counts_kinds_and_active_experts():
    cfg = shrunk("small", depth=12)
    model = HybridLM(cfg)
    rows = {r[0].split()[0]: r for r in parameter_rows(model)}
    kinds = Counter(model.layout)
    for kind, count in kinds.items():
        assert rows[kind][1] == count
    e_total, e_active = rows["E"][2], rows["E"][3]
    moe = next(b.mixer for b in model.blocks if b.kind == "E")
    per_layer_experts = moe.w_up.numel() + moe.w_down.numel()
    assert e_total - e_active == kinds["E"] * per_layer_experts // 2  # top-2 of 4 experts active
    assert rows["A"][2] == rows["A"][3]
    assert sum(r[2] for r in parameter_rows(model)) == sum(p.numel() for p in model.parameters())
    assert "all" in parameter_table(model)


def test_nam52_layout_on_meta_device():
    with torch.device("meta"):
        model = HybridLM(preset("nam52").model)
    assert Counter(model.layout) == {"A": 13, "M": 13, "R": 4, "E": 22}


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_tiny_compiles_fullgraph_forward_and_backward(backend):
    """The whole tiny model (doc_ids on) traces as one graph, forward and backward, no break."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = HybridLM(shrunk("tiny", depth=10))
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    idx = torch.randint(0, 97, (2, 16))
    doc_ids = torch.tensor([[0] * 7 + [1] * 9, [0] * 16])
    loss = compiled(idx, idx, doc_ids)
    loss.backward()
    assert _graph_breaks() == 0
    eager = model(idx, idx, doc_ids)
    assert (loss - eager).abs().item() <= 1e-4
