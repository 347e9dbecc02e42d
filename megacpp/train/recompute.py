"""Activation recompute per block kind, applied from outside the model before it is compiled.

``train.recompute`` names the block kinds whose mixers keep no activations for the backward: "none",
"all", or symbols such as "E" or "M,E" (megacpp.train.config.recompute_kinds reads it). Each such
block's mixer runs under non-reentrant `torch.utils.checkpoint.checkpoint`: its forward saves only its
inputs, and the backward runs it again to get the rest. Under torch.compile the checkpoint is traced
into the block's graph (a higher-order op the partitioner turns into a recompute inside the compiled
backward): no graph break, no recompile.

The mixer is the region, not the whole block: a block's norm and residual are cheap to keep, while
its mixer holds the large intermediates (an E block's routed rows and expert activations, M's chunked
scan, R's states). The recomputed forward is the forward: the same inputs through the same
deterministic kernels, so the MoE router picks the same experts in the recompute as in the forward,
and losses and gradients equal a run without recompute bit for bit (tests/test_recompute.py).
Replacing ``mixer.forward`` on the instance keeps every parameter name, hint and checkpoint key as it
was, and ``forward_step`` (decoding) is untouched.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint
from torch import nn


def _recomputed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_recompute(model: nn.Module, kinds: frozenset[str]) -> list[int]:
    """Make the mixers of ``model``'s blocks of ``kinds`` recompute in the backward; returns their indices.
    Call before compiling the model (its regions then trace the checkpoint)."""
    wrapped = []
    for index, block in enumerate(model.blocks):
        if block.kind in kinds:
            if "forward" in vars(block.mixer):
                raise RuntimeError(f"blocks.{index}.mixer.forward is already replaced (recompute applied twice?)")
            block.mixer.forward = _recomputed(block.mixer.forward)
            wrapped.append(index)
    return wrapped
