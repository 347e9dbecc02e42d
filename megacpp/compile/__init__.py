"""torch.compile policy, regional compile, compile health and cache hygiene (see docs/compile.md)."""
from megacpp.compile.cache import (
    CacheError,
    CacheStatus,
    describe_cache_dirs,
    export_cache,
    import_cache,
    setup_inductor_cache,
)
from megacpp.compile.config import CompileConfig
from megacpp.compile.entry import CompileStatus, prepare_compile
from megacpp.compile.env import apply_env, process_group_timeout
from megacpp.compile.health import (
    CompileHealth,
    CompileHealthError,
    HealthBounds,
    bounds_for,
    forbid_recompiles,
)
from megacpp.compile.lint import MutatedScalarError, assert_no_mutated_scalars, find_mutated_scalars
from megacpp.compile.logs import LogClassifier, LogKind
from megacpp.compile.policy import PolicyError, apply_policy
from megacpp.compile.regions import (
    CompiledModel,
    Region,
    compile_model,
    disable_unless,
    fallback_sites,
    mark_batch_dynamic,
)
from megacpp.compile.report import compile_report
from megacpp.compile.retry import reset_and_rebuild
from megacpp.compile.versions import GATES, parse_version, supports, torch_version

__all__ = [
    "GATES", "CacheError", "CacheStatus", "CompileConfig", "CompileHealth", "CompileHealthError",
    "CompileStatus", "CompiledModel", "HealthBounds", "LogClassifier", "LogKind", "MutatedScalarError",
    "PolicyError", "Region", "apply_env", "apply_policy", "assert_no_mutated_scalars", "bounds_for", "compile_model",
    "compile_report", "describe_cache_dirs", "disable_unless", "export_cache",
    "fallback_sites", "find_mutated_scalars", "mark_batch_dynamic",
    "forbid_recompiles", "import_cache", "parse_version", "prepare_compile", "process_group_timeout",
    "reset_and_rebuild", "setup_inductor_cache", "supports", "torch_version",
]
