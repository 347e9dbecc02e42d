"""Regional compile: none | model | blocks, with the batch axis marked dynamic by hand on warmup inputs.

Each region's ``forward`` is replaced, on the instance, by ``torch.compile(forward)``. Compared with
``nn.Module.compile()`` (which compiles ``_call_impl``) this keeps forward hooks outside the graph, so
the batch-marking hook below (and FSDP2's hooks) run eagerly, and state_dict keys are unchanged.
Blocks of one class share one code object, hence one Dynamo cache: identical blocks reuse one graph,
and each distinct variant (mixer type, engram on/off) is one more cache entry under the recompile cap.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch._dynamo
from torch import nn
from torch.utils.hooks import RemovableHandle

from megacpp.compile.config import CompileConfig
from megacpp.compile.policy import apply_policy


@dataclass
class CompiledModel:
    """Handle returned by `compile_model`: the (same) model, its compiled regions and warmup state."""

    model: nn.Module
    mode: str
    regions: list[tuple[str, nn.Module]] = field(default_factory=list)
    _hooks: list[RemovableHandle] = field(default_factory=list, repr=False)

    @property
    def warming_up(self) -> bool:
        return bool(self._hooks)

    def end_warmup(self) -> None:
        """Stop marking the batch axis: frames first compiled after this are static (and recompiles)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def mark_batch_dynamic(*tensors: torch.Tensor | None) -> None:
    """Mark dim 0 of each tensor dynamic for the compiles it reaches.

    ``maybe_mark_dynamic``, not the strict ``mark_dynamic``: if code specializes the batch (or a graph
    break hands a marked tensor to a frame that does), the result is a recompile on the next batch
    size, which the health counters and `forbid_recompiles` report with the failing guard, rather than
    a ConstraintViolationError deep in tracing. Sizes 0 and 1 are always specialized by Dynamo, so a
    batch of 1 cannot be a warmup batch.
    """
    for t in tensors:
        if t is None or t.dim() == 0:
            continue
        if t.size(0) < 2:
            raise ValueError(f"batch axis of size {t.size(0)} cannot be marked dynamic; warm up with >= 2")
        torch._dynamo.maybe_mark_dynamic(t, 0)


def _mark_batch_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0]
    if not tensors:
        return
    batch = tensors[0].size(0)
    # Only tensors that share the leading size are batched (x, targets, doc_ids); a (t, d) table is not.
    mark_batch_dynamic(*(t for t in tensors if t.size(0) == batch))


def _compile_forward(module: nn.Module, cfg: CompileConfig) -> None:
    if "forward" in vars(module):
        raise RuntimeError(f"{type(module).__qualname__}.forward is already replaced (compiled twice?)")
    module.forward = torch.compile(module.forward, backend=cfg.backend, fullgraph=cfg.fullgraph)


def compile_model(model: nn.Module, cfg: CompileConfig) -> CompiledModel:
    """Compile `model` in place per ``cfg.mode`` and return a handle; applies the policy first.

    ``blocks`` compiles each module of ``model.blocks`` (an ``nn.ModuleList``); ``model`` compiles the
    whole forward; ``none`` compiles nothing. With ``cfg.dynamic_batch`` the batch axis of every
    region's inputs is marked dynamic until `CompiledModel.end_warmup` is called.
    """
    apply_policy(cfg)
    handle = CompiledModel(model, cfg.mode)
    if cfg.mode == "none":
        return handle
    if cfg.mode == "blocks":
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ValueError("compile mode 'blocks' needs a non-empty nn.ModuleList at model.blocks")
        handle.regions = [(f"blocks.{i}", block) for i, block in enumerate(blocks)]
    else:
        handle.regions = [("", model)]
    for _, module in handle.regions:
        _compile_forward(module, cfg)
        if cfg.dynamic_batch:
            handle._hooks.append(module.register_forward_pre_hook(_mark_batch_hook, with_kwargs=True))
    return handle

