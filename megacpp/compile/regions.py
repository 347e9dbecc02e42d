"""Regional compile: none | model | blocks, with the batch axis marked dynamic by hand on warmup inputs.

Each region's ``forward`` is replaced, on the instance, by ``torch.compile(forward)``. Compared with
``nn.Module.compile()`` (which compiles ``_call_impl``) this keeps forward hooks outside the graph, so
the batch-marking hook below (and FSDP2's hooks) run eagerly, and state_dict keys are unchanged.
Blocks of one class share one code object, hence one Dynamo cache: identical blocks reuse one graph,
and each distinct variant (mixer type, engram on/off) is one more cache entry under the recompile cap.

``blocks`` mode also compiles the methods a model names in its ``method_regions`` class attribute (the
hybrid's ``segments``: documents and attention mask, once per forward; its ``loss``: final norm, LM
head, soft-cap, cross-entropy, MTP heads) as one region each, replaced on the instance like
``forward``; the code between the regions stays eager.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from megacpp.compile.config import CompileConfig
from megacpp.compile.cudagraphs import decide_cudagraphs
from megacpp.compile.policy import apply_policy


@dataclass(frozen=True)
class Region:
    """One compiled region: the method `method` of `module`, replaced on the instance."""

    name: str  # "blocks.3", "loss", "" for the whole model
    module: nn.Module
    method: str = "forward"


class _MethodMarking:
    """Batch marking of a compiled method's inputs during warmup; `remove` ends it (the handle
    interface that `CompiledModel.end_warmup` calls, like a removed forward pre-hook)."""

    def __init__(self) -> None:
        self.active = True

    def remove(self) -> None:
        self.active = False


@dataclass
class CompiledModel:
    """Handle returned by `compile_model`: the (same) model, its compiled regions and warmup state."""

    model: nn.Module
    mode: str
    regions: list[Region] = field(default_factory=list)
    cudagraphs: bool = False  # the regions replay as CUDA graphs: each step must begin with begin_graph_step()
    cudagraphs_why: str = "off (nothing compiled)"
    _hooks: list[RemovableHandle | _MethodMarking] = field(default_factory=list, repr=False)

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
    # Tensors inside pytree containers too: the hybrid's blocks take the batch's `Segments` NamedTuple.
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.dim() > 0]
    if not tensors:
        return
    batch = tensors[0].size(0)
    if batch < 2:  # Dynamo specializes sizes 0 and 1: a micro-batch of 1 compiles static, as it always runs
        return
    # Only tensors that share the leading size are batched (x, targets, doc_ids); a (t, d) table is not.
    mark_batch_dynamic(*(t for t in tensors if t.size(0) == batch))


def _compile_region(region: Region, cfg: CompileConfig, handle: CompiledModel) -> None:
    module, method = region.module, region.method
    if method in vars(module):
        raise RuntimeError(f"{type(module).__qualname__}.{method} is already replaced (compiled twice?)")
    mode = "reduce-overhead" if handle.cudagraphs else None
    compiled = torch.compile(getattr(module, method), backend=cfg.backend, fullgraph=cfg.fullgraph, mode=mode)
    if method == "forward" or not cfg.dynamic_batch:
        setattr(module, method, compiled)
        if method == "forward" and cfg.dynamic_batch:
            handle._hooks.append(module.register_forward_pre_hook(_mark_batch_hook, with_kwargs=True))
        return
    # A method has no pre-hooks: a plain wrapper marks its inputs, outside the compiled code.
    marking = _MethodMarking()
    handle._hooks.append(marking)

    def region_call(*args: Any, **kwargs: Any) -> Any:
        if marking.active:
            _mark_batch_hook(module, args, kwargs)
        return compiled(*args, **kwargs)

    setattr(module, method, region_call)


def compile_model(model: nn.Module, cfg: CompileConfig, device: torch.device | None = None) -> CompiledModel:
    """Compile `model` in place per ``cfg.mode`` and return a handle; applies the policy first.

    ``blocks`` compiles each module of ``model.blocks`` (an ``nn.ModuleList``) and each method the
    model names in ``method_regions``; ``model`` compiles the whole forward; ``none`` compiles nothing.
    With ``cfg.dynamic_batch`` the batch axis of every region's inputs is marked dynamic until
    `CompiledModel.end_warmup` is called. Whether the regions replay as CUDA graphs is decided here
    (`decide_cudagraphs`: ``compile.cudagraphs`` on where the device and process allow it); ``device`` is
    where the regions will run, by default where the model's parameters are (a model built on meta names it).
    """
    apply_policy(cfg)
    handle = CompiledModel(model, cfg.mode)
    if cfg.mode == "none":
        return handle
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    handle.cudagraphs, handle.cudagraphs_why = decide_cudagraphs(cfg, device)
    if cfg.mode == "blocks":
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ValueError("compile mode 'blocks' needs a non-empty nn.ModuleList at model.blocks")
        handle.regions = [Region(f"blocks.{i}", block) for i, block in enumerate(blocks)]
        handle.regions += [Region(name, model, name) for name in getattr(model, "method_regions", ())]
    else:
        handle.regions = [Region("", model)]
    for region in handle.regions:
        _compile_region(region, cfg, handle)
    return handle

