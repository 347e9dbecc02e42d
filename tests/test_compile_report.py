"""compile_report lists callsites, breaks with reasons and recompiles for a stand-in model."""
from __future__ import annotations

import pytest

from megacpp.compile.report import compile_report
from tests.compile_fixtures.standin import FFNMixer, build_standin

pytestmark = pytest.mark.usefixtures("isolated_dynamo")


class PrintingFFN(FFNMixer):
    def forward(self, x, doc_ids=None):
        print("debug print left in a mixer")
        return super().forward(x)


def _with_planted_break():
    model = build_standin("AF")
    model.blocks[1].mixer = PrintingFFN(32)
    return model


def test_table_for_a_clean_model():
    text = compile_report(lambda: build_standin("AMERF"), backend="eager", mode="blocks")
    header = next(line for line in text.splitlines() if line.startswith("callsite"))
    assert header.split()[:4] == ["callsite", "modules", "graphs", "breaks"]
    row = next(line for line in text.splitlines() if line.startswith("Block.forward")).split()
    assert row[1:4] == ["5", "5", "0"]  # 5 blocks, 5 variants (mixer types), no break
    assert row[5] == "0"  # no recompile after warmup (the smaller batch reused the graphs)
    assert "health: within bounds" in text
    assert "recompile_limit = 64" in text


def test_breaks_and_reasons_are_listed():
    text = compile_report(_with_planted_break, backend="eager", mode="model")
    assert "StandInLM.forward" in text
    assert "graph breaks:" in text and "print" in text
    assert "BOUND EXCEEDED" in text and "graph break site" in text


def test_small_batch_is_refused():
    with pytest.raises(ValueError, match="batch must be >= 3"):
        compile_report(build_standin, batch=2)
