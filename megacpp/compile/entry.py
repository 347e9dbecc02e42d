"""`prepare_compile`: everything the training entry point sets before the first compile, in order."""
from __future__ import annotations

from dataclasses import dataclass

from megacpp.compile.cache import CacheStatus, SyncResult, import_cache, setup_inductor_cache
from megacpp.compile.config import CompileConfig
from megacpp.compile.env import EnvReport, apply_env
from megacpp.compile.policy import PolicyStatus, apply_policy


@dataclass
class CompileStatus:
    cache: CacheStatus
    env: EnvReport
    policy: PolicyStatus
    imported: SyncResult | None = None  # compile.import_cache's import (or skip)

    def format(self) -> str:
        lines = [self.cache.format(), *([self.imported.format()] if self.imported else []), self.env.format(),
                 self.policy.format()]
        return "\n".join(lines)


def prepare_compile(cfg: CompileConfig, process_group_timeout_s: float | None = None) -> CompileStatus:
    """Choose the Inductor cache dir (and import ``compile.import_cache`` into it), apply the GPU/torchrun
    env defaults, apply the Dynamo policy.

    Call once at entry, before any model is compiled (and, under torchrun, before the process group
    is created); put ``status.format()`` in the run's status and in `doctor`. ``process_group_timeout_s``
    is the timeout the process group will be created with (dist.init_timeout_s), for the report.
    """
    cache = setup_inductor_cache(cfg.cache_dir or None)
    imported = import_cache(cfg.import_cache) if cfg.import_cache else None
    env = apply_env(cfg, process_group_timeout_s=process_group_timeout_s)
    return CompileStatus(cache, env, apply_policy(cfg), imported)
