"""The block kinds: one table read by the pattern parser, the model, the parameter table and the tests.

A new kind is its mixer module plus one entry here. A mixer is built as ``cls(d_model, sub_config,
layer_idx)`` and called as ``mixer(x, segments)``: x (b, t, d), and the batch's `Segments`
(megacpp.model.segments), the document structure the model computes once per forward (the default,
``WHOLE_ROWS``, makes each row one document); decoding uses ``init_cache`` and ``forward_step``.
What only some kinds need is an optional hook the code asks for by name, never an ``isinstance``:

- ``attention_mask_kind(device, has_documents) -> MaskKind``: the attention mask the mixer reads from
  its segments; the model builds it once per forward when some mixer has this hook;
- ``inactive_parameters() -> int``: parameters a token does not touch (routed experts), for the
  active-parameter count and MFU;
- ``param_hints`` (optimizer routing), ``reduced_buffers`` (statistics summed across ranks) and
  ``after_optimizer_step`` (post-step work): see `megacpp.model.hints`.

Mixer classes are named by import path and loaded on first use, so the pattern parser (and the config
gate that uses it) imports no model code.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class BlockKind:
    symbol: str
    description: str
    config_field: str  # the ModelConfig attribute holding this kind's sub-config
    mixer_path: str  # "module:Class"

    def mixer_class(self) -> type[nn.Module]:
        module, _, name = self.mixer_path.partition(":")
        return getattr(importlib.import_module(module), name)


BLOCK_KINDS: dict[str, BlockKind] = {kind.symbol: kind for kind in (
    BlockKind("A", "attention", "attention", "megacpp.model.attention:Attention"),
    BlockKind("M", "Mamba-3", "mamba", "megacpp.model.mamba3:Mamba3"),
    BlockKind("R", "M2RNN recurrence", "rnn", "megacpp.model.m2rnn:M2RNN"),
    BlockKind("E", "mixture-of-experts FFN", "moe", "megacpp.model.moe:MoE"),
    BlockKind("F", "dense FFN", "ffn", "megacpp.model.ffn:FFN"),
)}
