"""The Dynamo policy, applied once before anything is traced, and its status report.

Static first: shapes are static unless marked by hand (the batch axis, see regions.py), scalars
returned by ops are captured instead of breaking, and the recompile caps fit a deep hybrid whose
blocks share one code object. `suppress_errors` is never set here: if something does not compile,
we want the error.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch._dynamo

from megacpp.compile.config import CompileConfig
from megacpp.errors import MegacppError
from megacpp.versions import supports, torch_version

log = logging.getLogger(__name__)


class PolicyError(MegacppError, RuntimeError):
    """A policy setting cannot be found or does not read back on this torch."""


@dataclass(frozen=True)
class Knob:
    """Where one policy setting lives in ``torch._dynamo.config``."""

    name: str  # attribute name on torch versions that pass `gate` (or on every version if no gate)
    legacy: str | None = None  # attribute name on torch versions that fail `gate`
    gate: str | None = None  # versions.GATES key that picks `name` or `legacy`

    def resolve(self) -> str:
        if self.gate is None or supports(self.gate):
            return self.name
        if self.legacy is None:
            raise PolicyError(f"no name for dynamo setting {self.name!r} before gate {self.gate!r}")
        return self.legacy


# policy key -> where it lives. 2.11 and 2.13 both use the new names; the legacy names are aliases there.
KNOBS: dict[str, Knob] = {
    "capture_scalar_outputs": Knob("capture_scalar_outputs"),
    "recompile_limit": Knob("recompile_limit", "cache_size_limit", "recompile_limit_names"),
    "accumulated_recompile_limit": Knob(
        "accumulated_recompile_limit", "accumulated_cache_size_limit", "recompile_limit_names"
    ),
    "automatic_dynamic_shapes": Knob("automatic_dynamic_shapes"),
    "assume_static_by_default": Knob("assume_static_by_default"),
    "enable_compiler_collectives": Knob("enable_compiler_collectives"),  # crashes on gloo; rank divergence
    "fail_on_recompile_limit_hit": Knob("fail_on_recompile_limit_hit"),
}

# The six lines every run gets (the contract); fail_on_recompile_limit_hit comes from CompileConfig.
POLICY: dict[str, Any] = {
    "capture_scalar_outputs": True,
    "recompile_limit": 64,  # per code object: identical blocks share one, each variant is an entry
    "accumulated_recompile_limit": 256,
    "automatic_dynamic_shapes": False,  # never promote a dim to dynamic after seeing two sizes
    "assume_static_by_default": True,
    "enable_compiler_collectives": False,
}


@dataclass(frozen=True)
class SettingStatus:
    key: str
    name: str  # the dynamo config attribute actually written
    value: Any
    previous: Any


@dataclass
class PolicyStatus:
    """What `apply_policy` set, for the run's status and `doctor`."""

    torch_version: str
    settings: list[SettingStatus] = field(default_factory=list)
    suppress_errors: bool = False
    compiles_before: int = 0  # frames Dynamo compiled before the first application (should be 0)
    applications: int = 1

    def format(self) -> str:
        lines = [f"dynamo policy (torch {self.torch_version}, applied {self.applications}x):"]
        for s in self.settings:
            changed = "" if s.previous == s.value else f"  (was {s.previous!r})"
            alias = "" if s.name == s.key else f" [as {s.name}]"
            lines.append(f"  {s.key}{alias} = {s.value!r}{changed}")
        lines.append(f"  suppress_errors = {self.suppress_errors!r}")
        if self.compiles_before:
            lines.append(f"  WARNING: {self.compiles_before} frame(s) were compiled before the policy")
        return "\n".join(lines)


_status: PolicyStatus | None = None


def _compiled_frames() -> int:
    return int(torch._dynamo.utils.counters["frames"]["ok"])


def apply_policy(cfg: CompileConfig | None = None) -> PolicyStatus:
    """Set the Dynamo policy and return what was set. Idempotent; call before any compile.

    Raises `PolicyError` if a setting's name (picked through the version-gate table) does not exist on
    the running torch, or if a value does not read back.
    """
    global _status
    cfg = cfg or CompileConfig()
    wanted = dict(POLICY, fail_on_recompile_limit_hit=cfg.fail_on_recompile_limit_hit)
    config = torch._dynamo.config
    names = {key: KNOBS[key].resolve() for key in wanted}
    missing = [f"{key} (as {name!r})" for key, name in names.items() if not hasattr(config, name)]
    if missing:
        raise PolicyError(
            f"torch {torch_version()} has no dynamo setting for: {', '.join(missing)}; "
            "update KNOBS / GATES in megacpp.compile"
        )
    settings = []
    for key, value in wanted.items():
        previous = getattr(config, names[key])
        setattr(config, names[key], value)
        if getattr(config, names[key]) != value:
            raise PolicyError(f"dynamo setting {names[key]} = {value!r} did not read back")
        settings.append(SettingStatus(key, names[key], value, previous))
    if _status is None:
        status = PolicyStatus(str(torch_version()), settings, config.suppress_errors, _compiled_frames())
        if status.compiles_before:
            log.warning("compile policy applied after %d compiled frame(s)", status.compiles_before)
    else:
        status = PolicyStatus(
            _status.torch_version, settings, config.suppress_errors, _status.compiles_before,
            _status.applications + 1,
        )
    _status = status
    return status

