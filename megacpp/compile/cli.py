"""Entry points for ``megacpp compile-report`` and ``megacpp cache export|import``."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Protocol

import torch

from megacpp.compile.cache import CacheError, export_cache, import_cache, setup_inductor_cache
from megacpp.compile.report import compile_report, token_inputs
from megacpp.data.config import DataConfig
from megacpp.model.config import ModelConfig


class RunConfig(Protocol):
    """The sections of a run's `megacpp.config.Config` the report reads (that module composes this
    package's own section, so it sits above it)."""

    model: ModelConfig
    data: DataConfig


def compile_report_cli(cfg: RunConfig, backend: str = "eager", mode: str = "blocks", device: str = "auto") -> str:
    """The compile report for the HybridLM of `cfg` (preset and overrides already applied)."""
    from megacpp.model.hybrid import HybridLM

    model_cfg = copy.deepcopy(cfg.model)
    target = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    return compile_report(lambda: HybridLM(model_cfg), backend, mode,
                          make_inputs=token_inputs(cfg.data.seq_len), device=target)


def cache_cli(action: str, path: Path | str) -> str:
    """``export``: copy the local warm cache into `path`; ``import``: the reverse. Returns what happened."""
    status = setup_inductor_cache()
    if status.source == "fallback":  # the warm cache the user means is not this temporary one
        raise CacheError(f"cannot {action} the compile cache: its root is unusable ({status.fallback_reason}); "
                         "set MEGACPP_CACHE_DIR to a writable directory")
    if action == "export":
        result = export_cache(path)
    elif action == "import":
        result = import_cache(path)
    else:
        raise ValueError(f"cache action must be export or import, got {action!r}")
    return f"{status.format()}\n{result.format()}"
