"""GPU compile defaults and the torchrun environment, applied at entry and reported.

Max-autotune stays off unless asked (its benchmarking subprocess OOMed on large GEMMs and poisoned the
cache with a bad pick); autotune-in-subprocess is a switch. Under torchrun a cold compile of the deep
hybrid outlasts NCCL's default heartbeat (480 s on 2.11) and process-group timeout (10 min), killing
the rank mid-compile, so unless the user set them: monitoring off and heartbeat 7200 s. The
process-group timeout itself is ``dist.init_timeout_s`` (7200 s by default), passed to whoever creates
the group; the report prints the value it is given. The NCCL variables are read when the process
group is created: apply before ``init_process_group``.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from megacpp.compile.config import CompileConfig

TORCHRUN_DEFAULTS: dict[str, str] = {
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "7200",
}


@dataclass
class EnvReport:
    under_torchrun: bool
    set: dict[str, str] = field(default_factory=dict)  # variables this call set
    kept: dict[str, str] = field(default_factory=dict)  # variables the user had set: left alone
    inductor: dict[str, bool] = field(default_factory=dict)
    process_group_timeout_s: float | None = None  # dist.init_timeout_s of the run; None: not known here

    def format(self) -> str:
        lines = [f"compile env: torchrun={'yes' if self.under_torchrun else 'no'}"]
        lines += [f"  set {k}={v}" for k, v in self.set.items()]
        lines += [f"  kept user {k}={v}" for k, v in self.kept.items()]
        lines += [f"  inductor.{k}={v}" for k, v in self.inductor.items()]
        if self.under_torchrun and self.process_group_timeout_s is not None:
            lines.append(f"  process-group timeout {self.process_group_timeout_s:g} s (dist.init_timeout_s)")
        return "\n".join(lines)


def apply_env(cfg: CompileConfig | None = None, environ: MutableMapping[str, str] | None = None,
              process_group_timeout_s: float | None = None) -> EnvReport:
    """Apply the Inductor autotune defaults and, under torchrun (LOCAL_RANK set), the NCCL defaults.
    ``process_group_timeout_s`` (the run's dist.init_timeout_s) is only reported."""
    import torch._inductor.config as inductor_config

    cfg = cfg or CompileConfig()
    env = os.environ if environ is None else environ
    report = EnvReport(under_torchrun="LOCAL_RANK" in env, process_group_timeout_s=process_group_timeout_s)
    if report.under_torchrun:
        for key, value in TORCHRUN_DEFAULTS.items():
            if key in env:
                report.kept[key] = env[key]
            else:
                env[key] = value
                report.set[key] = value
    # "asked" = the config or the user's own Inductor variable, which Inductor read at import.
    autotune = cfg.max_autotune or env.get("TORCHINDUCTOR_MAX_AUTOTUNE") == "1"
    autotune_gemm = autotune or env.get("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM") == "1"
    subprocess = cfg.autotune_subprocess or env.get("TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC") == "1"
    inductor_config.max_autotune = autotune
    inductor_config.max_autotune_gemm = autotune_gemm
    inductor_config.autotune_in_subproc = subprocess
    report.inductor = {"max_autotune": autotune, "max_autotune_gemm": autotune_gemm, "autotune_in_subproc": subprocess}
    return report
