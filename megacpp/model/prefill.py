"""Reading a prompt into a decode cache in one pass: a module's own ``prefill`` hook, or its
``forward_step`` over the prompt's positions.

``prefill(x, cache) -> y``: x (b, t, ...) the whole prompt, cache fresh from the module's ``init_cache``;
y as ``forward(x)`` gives it, and the cache left as t calls of ``forward_step`` would leave it (up to
floating point: a parallel form sums in another order). A kind without the hook still decodes: the
fallback loops its ``forward_step``, one call per position, which is correct and as slow as before.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def prefill_by_steps(module: nn.Module, x: Tensor, cache: Any) -> Tensor:
    """``module.forward_step`` on each position of x (b, t, ...) in turn, outputs joined along t."""
    return torch.cat([module.forward_step(x[:, i : i + 1], cache) for i in range(x.shape[1])], dim=1)


def module_prefill(module: nn.Module, x: Tensor, cache: Any) -> Tensor:
    """The prompt x (b, t, ...) through `module` into its fresh `cache`: its own ``prefill`` when it has
    one (an optional hook, asked for by name like the registry's others), else `prefill_by_steps`."""
    own = getattr(module, "prefill", None)
    if own is not None:
        return own(x, cache)
    return prefill_by_steps(module, x, cache)
