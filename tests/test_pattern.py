from collections import Counter

import pytest

from megacpp.model.pattern import PatternError, expand_pattern, validate_pattern
from megacpp.model.registry import BLOCK_KINDS


def test_nam52_tiling_counts():
    layout = expand_pattern("AEMEAEMEAEMR", 52)
    assert len(layout) == 52
    assert Counter(layout) == {"A": 13, "M": 13, "R": 4, "E": 22}


def test_exact_multiple_and_remainder():
    assert expand_pattern("AM", 4) == "AMAM"
    assert expand_pattern("AMF", 5) == "AMFAM"


@pytest.mark.parametrize(
    ("pattern", "position", "symbol"), [("AEXM", 2, "X"), ("aEM", 0, "a"), ("AE M", 2, " ")]
)
def test_unknown_symbol_names_position_and_allowed(pattern, position, symbol):
    with pytest.raises(PatternError) as err:
        validate_pattern(pattern)
    msg = str(err.value)
    assert f"position {position}" in msg and repr(symbol) in msg
    for allowed in BLOCK_KINDS:
        assert f"{allowed} (" in msg


def test_empty_pattern_is_an_error():
    with pytest.raises(PatternError, match="empty"):
        expand_pattern("", 4)


@pytest.mark.parametrize("depth", [0, -1, 3])
def test_depth_that_cannot_fill_the_pattern(depth):
    with pytest.raises(PatternError, match="cannot fill"):
        expand_pattern("AEMR", depth)


def test_tier1_every_registered_kind_builds_from_the_registry():
    """The registry is the one table: each symbol's mixer is built from its own sub-config, and the
    pattern error lists every registered kind. Breaks if a kind is added to one place only."""
    from megacpp.model.config import ModelConfig
    from megacpp.model.hybrid import Block

    cfg = ModelConfig(vocab_size=64, d_model=64, depth=5, pattern="".join(BLOCK_KINDS))
    cfg.attention.n_heads, cfg.attention.n_kv_heads, cfg.attention.head_dim = 2, 1, 32
    for symbol, kind in BLOCK_KINDS.items():
        block = Block(symbol, cfg, 0)
        assert type(block.mixer) is kind.mixer_class()
        assert hasattr(cfg, kind.config_field)
    with pytest.raises(PatternError) as err:
        validate_pattern("AX")
    for symbol, kind in BLOCK_KINDS.items():
        assert f"{symbol} ({kind.description})" in str(err.value)
