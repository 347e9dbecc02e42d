"""What a module tells the training stack about its parameters and statistics, by name.

Declarations live on modules, keyed by the parameter's or buffer's name relative to the module, and
are collected by fully qualified name before any wrapping. Attributes set on Parameter objects would
not survive: FSDP2's ``fully_shard`` replaces every parameter with a new DTensor parameter (measured:
8 of the default model's 61 parameters changed optimizer and the split-QKV sizes were lost).

- ``param_hints: dict[str, ParamHint]``: optimizer choice, Muon learning-rate scaling, split-QKV
  row sizes, no weight decay, a bound on the spectral norm kept after every optimizer step.
- ``reduced_buffers: dict[str, "sum" | "max"]``: per-forward statistics that feed back into weights or
  control flow (MoE expert counts, attention logit bounds). Under data parallelism each rank sees its
  own batch, so these are reduced across ranks before anything reads them.
- ``after_optimizer_step()``: a method run after every optimizer step, outside compiled code (MoE
  load balancing).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

Reduction = Literal["sum", "max"]
# Path components added by wrappers (torch.compile, DDP, activation checkpointing); not model names.
_WRAPPERS = frozenset({"_orig_mod", "module", "_checkpoint_wrapped_module"})


@dataclass(frozen=True)
class ParamHint:
    optimizer: str | None = None  # a name in megacpp.optim.registry.OPTIMIZERS; None: the routing rules decide
    lr_scaling: Literal["original", "match_rms_adamw"] | None = None  # Muon lr scaling override
    qkv_split: tuple[int, ...] | None = None  # Muon orthogonalizes each output-row slice on its own
    no_decay: bool = False  # never weight-decayed
    # After every optimizer step each matrix (last two dims) is rescaled to at most this largest
    # singular value (megacpp.optim.spectral_cap); None: unbounded.
    max_spectral_norm: float | None = None
    # A routed expert's stacked weights: optim.expert_optimizer picks Muon or AdamW for them.
    routed_expert: bool = False


def canonical_name(name: str) -> str:
    """A parameter's name with wrapper components removed."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def _declared(model: nn.Module, attribute: str) -> Iterator[tuple[str, str, object, nn.Module]]:
    for prefix, module in model.named_modules():
        for local, value in getattr(module, attribute, {}).items():
            yield canonical_name(f"{prefix}.{local}" if prefix else local), local, value, module


def collect_param_hints(model: nn.Module) -> dict[str, ParamHint]:
    """Every declared parameter hint of `model` by fully qualified name; a hint naming no parameter of
    its module is an error (a typo would otherwise silently route by the defaults)."""
    hints: dict[str, ParamHint] = {}
    for name, local, hint, module in _declared(model, "param_hints"):
        if local not in dict(module.named_parameters()):
            raise ValueError(f"{type(module).__name__} declares a hint for {local!r}, which is not one of "
                             "its parameters")
        hints[name] = hint
    return hints


def reduced_buffers(model: nn.Module) -> list[tuple[str, Tensor, Reduction]]:
    """(name, buffer, reduction) of every declared per-forward statistic, in module order."""
    found = []
    for name, local, how, module in _declared(model, "reduced_buffers"):
        buffer = dict(module.named_buffers()).get(local)
        if buffer is not None:  # optional statistics (e.g. logit bounds only with QK-clip on)
            found.append((name, buffer, how))
    return found


def run_after_optimizer_step(model: nn.Module) -> None:
    """Call every module's ``after_optimizer_step`` hook, in module order."""
    for module in model.modules():
        hook = getattr(module, "after_optimizer_step", None)
        if hook is not None:
            hook()
