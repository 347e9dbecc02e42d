"""Long context (issue 36): a 16K-token row of documents on every block kind, decoding past 8,192
positions, and the documented RoPE base period per length."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megacpp.config import ConfigError, apply_overrides
from megacpp.model.attention import Attention
from megacpp.model.attention_config import AttentionConfig
from megacpp.model.hybrid import HybridLM
from megacpp.model.rope_theta import rope_theta_for_length
from megacpp.presets import PRESETS, preset
from megacpp.validate import validate_config
from tests.test_hybrid import LOGIT_ATOL, randomize, shrunk

ROW = 16384
# One document longer than the default 8,192-row tables, a one-token document, and two more.
DOCUMENT_LENGTHS = [9000, 1, 4000, ROW - 9000 - 1 - 4000]


def test_tier3_atol_1e4_a_16k_row_of_documents_equals_per_document_runs():
    """Every block kind (A, E, M, F, R, Engram and the n-gram hash) at test width on one row of 16,384
    tokens: each document's logits equal the document run alone, so the attention mask, the RoPE positions
    (restarting at each document, past 8,192 in the first), the Mamba-3 and M2RNN resets and the n-gram
    history all stop at the boundaries. Same tolerance and reasoning as tests/test_hybrid.py's packed
    documents; ~10 s and ~1.8 GB on CPU (the dense keep-mask is 16K x 16K)."""
    cfg = shrunk("tiny", depth=5)
    assert set(cfg.pattern) == set("AEMFR") and cfg.engram.layers and cfg.engram.ngram_hash
    cfg.attention.max_seq_len, cfg.attention.rope_theta = ROW, rope_theta_for_length(ROW)
    torch.manual_seed(7)
    model = randomize(HybridLM(cfg), seed=7).eval()
    idx = torch.randint(0, 97, (1, ROW), generator=torch.Generator().manual_seed(8))
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCUMENT_LENGTHS)])[None]
    with torch.no_grad():
        packed = model(idx, doc_ids=doc_ids)[0]
        start = 0
        for n in DOCUMENT_LENGTHS:
            alone = model(idx[:, start : start + n])[0]
            diff = (packed[start : start + n] - alone).abs().max().item()
            assert diff <= LOGIT_ATOL, f"document at {start} ({n} tokens) differs by {diff}"
            start += n
        unmasked = model(idx)[0]
    later = slice(DOCUMENT_LENGTHS[0], ROW)  # without doc_ids the later documents see the first
    assert (packed[later] - unmasked[later]).abs().max() > 1e-3, "the guard: documents must matter"


def test_tier3_decode_past_8192_positions_equals_the_forward():
    """An attention layer with the default 8,192-row tables decodes positions 8,192..8,199 (the cache
    carries the rows past its tables) and matches the forward of the same weights with 8,200-row tables,
    within test_attention's fp32 tolerance scaled to this length. The cache's first 8,192 positions are
    written from the forward's own projection (the same table rows a step would read): stepping through
    all of them costs ~40 s on 2 cores."""
    torch.manual_seed(3)
    cfg = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=8)
    assert cfg.max_seq_len == 8192
    module = Attention(32, cfg, layer_idx=0)
    nn.init.normal_(module.proj.weight, std=32**-0.5)
    longer = Attention(32, AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=8200), layer_idx=0)
    longer.load_state_dict(module.state_dict())
    x = torch.randn(1, 8200, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = longer(x)
        cache = module.init_cache(1, max_len=8200, device="cpu", dtype=torch.float32)
        _, k, v = module._project(x[:, :8192], torch.arange(8192)[None], module.rope_cos, module.rope_sin)
        cache["k"][:, :, :8192], cache["v"][:, :, :8192] = k, v
        cache["pos"].fill_(8192)
        steps = torch.cat([module.forward_step(x[:, i : i + 1], cache) for i in range(8192, 8200)], dim=1)
    # fp32 softmax over 8,192 keys: rounding grows with the sum's length; 1e-5 is ~100 ulps of these
    # O(1) outputs, and a wrong rotation (table row off by one) moves them by > 1e-2.
    assert (steps - full[:, 8192:]).abs().max().item() <= 1e-5
    assert cache["rope_cos"].shape[0] == 8200 and module.rope_cos.shape[0] == 8192


def test_tier1_rope_theta_rule_per_length():
    """The documented values (README "Long context"), and every preset trains at a length whose rule is the
    default base period: the rule changes no existing run."""
    assert [rope_theta_for_length(n) for n in (256, 8192, 8193, 16384, 32768, 32769, 65536)] == [
        10_000.0, 10_000.0, 500_000.0, 500_000.0, 500_000.0, 1_000_000.0, 1_000_000.0]
    with pytest.raises(ValueError, match="no documented rope_theta for 65537 tokens"):
        rope_theta_for_length(65537)
    for name in PRESETS:
        cfg = preset(name)
        assert cfg.model.attention.rope_theta == rope_theta_for_length(cfg.data.seq_len), name


def test_tier1_a_row_longer_than_the_tables_names_the_settings_that_fit():
    cfg = apply_overrides(preset("small"), [("data.seq_len", "16384")])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    message = str(info.value)
    assert "data.seq_len exceeds model.attention.max_seq_len" in message
    assert "--model.attention.max_seq_len 16384 and, as documented for this length, " \
           "--model.attention.rope_theta 500000" in message
    fitted = apply_overrides(cfg, [("model.attention.max_seq_len", "16384"), ("model.attention.rope_theta", "5e5")])
    validate_config(fitted)
