"""Lint: Python scalar attributes mutated in forward are named."""
from __future__ import annotations

import pytest
import torch

from megacpp.compile.report import random_token_batch
from tests.compile_fixtures.lint import MutatedScalarError, assert_no_mutated_scalars, find_mutated_scalars
from tests.compile_fixtures.standin import FFNMixer, MoEMixer, build_standin


class OverflowCountingMoE(MoEMixer):
    """The seed's time bomb: MoE._overflow_total as a Python int."""

    def __init__(self, d_model: int) -> None:
        super().__init__(d_model)
        self._overflow_total = 0

    def forward(self, x, doc_ids=None):
        y = super().forward(x, doc_ids)
        self._overflow_total += 1
        return y


class FirstCallFlag(FFNMixer):
    def forward(self, x, doc_ids=None):
        self.warned = True  # an attribute that appears in forward
        self.scale = 0.5
        return super().forward(x) * self.scale


def _batch():
    return random_token_batch(64, 2, 8)


def test_clean_model_passes():
    with torch.no_grad():
        assert_no_mutated_scalars(build_standin("AMERF"), **_batch())


def test_planted_int_counter_is_named():
    model = build_standin("AEF")
    model.blocks[1].mixer = OverflowCountingMoE(32)
    with torch.no_grad(), pytest.raises(MutatedScalarError, match=r"blocks\.1\.mixer\._overflow_total: 0 -> 2"):
        assert_no_mutated_scalars(model, **_batch())


def test_attributes_created_in_forward_are_named():
    model = build_standin("F")
    model.blocks[0].mixer = FirstCallFlag(32)
    with torch.no_grad():
        found = {m.path: (m.before, m.after) for m in find_mutated_scalars(model, **_batch())}
    assert found == {"blocks.0.mixer.warned": (None, True), "blocks.0.mixer.scale": (None, 0.5)}


def test_unchanged_scalars_and_buffers_are_not_reported():
    model = build_standin("E")  # MoE overwrites its statistics buffers every forward: fine
    model.blocks[0].mixer.top_k = 2  # a constant int read in forward: fine
    with torch.no_grad():
        assert find_mutated_scalars(model, steps=3, **_batch()) == []
