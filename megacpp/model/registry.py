"""The block kinds: one table read by the pattern parser, the model, the parameter table and the tests.

A new kind is its mixer module, its config module, one entry here and one `ModelConfig` field
(docs/architecture.md, "Adding a block kind"). The config module (``<kind>_config.py``, torch-free so that
reading a configuration loads no torch) holds its config section: a dataclass deriving from
`megacpp.rules.ConfigSection`, whose ``ranges()`` and ``check(keys)`` (with the model's ``d_model``) both
the mixer's constructor (`megacpp.rules.check_alone`) and the configuration gate run, the gate only
when the pattern uses the kind; the entry's ``config_field`` names the ModelConfig field holding it.

A mixer is built as ``cls(d_model, sub_config, layer_idx)`` and called as ``mixer(x, segments)``: x
(b, t, d), and the batch's `Segments` (megacpp.model.segments), the document structure the model
computes once per forward (the default, ``WHOLE_ROWS``, makes each row one document); decoding uses
``init_cache(batch_size, max_len, device, dtype)``, which returns the layer's cache as a dict of
tensors, and ``forward_step(x, cache)``; ``reset_parameters()`` initialises the weights again (the model
calls it after a build on the meta device).

What only some kinds need is an optional hook the code asks for by name, never an ``isinstance``:

- ``attention_mask_kind(device, has_documents) -> MaskKind``: the attention mask the mixer reads from
  its segments; the model builds it once per forward when some mixer has this hook;
- ``inactive_parameters() -> int``: parameters a token does not touch (routed experts), for the
  active-parameter count and MFU;
- ``param_hints`` (optimizer routing), ``reduced_buffers`` (statistics summed across ranks) and
  ``after_optimizer_step`` (post-step work): see `megacpp.model.hints`;
- ``prefill(x, cache) -> y``: a whole prompt into a fresh decode cache in one pass; without it decoding
  calls ``forward_step`` once per prompt position (`megacpp.model.prefill`).

Mixer classes are named by import path and loaded on first use, so the pattern parser imports no model
code.
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
