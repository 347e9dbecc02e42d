"""GPU compile defaults and the torchrun environment, applied at entry and reported.

Max-autotune stays off unless asked (its benchmarking subprocess OOMed on large GEMMs and poisoned the
cache with a bad pick); autotune-in-subprocess is a switch. Under torchrun a cold compile of the deep
hybrid outlasts NCCL's default heartbeat (480 s on 2.11) and process-group timeout (10 min), killing
the rank mid-compile, so unless the user set them: monitoring off and heartbeat 7200 s. The
process-group timeout itself is ``dist.init_timeout_s`` (7200 s by default), passed to whoever creates
the group; the report prints the value it is given. The NCCL variables are read when the process
group is created: apply before ``init_process_group``.

Triton's ptxas is pinned to the one torch ships (``TRITON_PTXAS_PATH``, unless the user set it), before
anything compiles. Inductor makes that same choice, but only at its first Triton compile in the process
itself, and Triton keys every kernel by the version of the ptxas it ran first. On torch 2.11+cu130 the
trainer had keyed megacpp's kernels with Triton's bundled ptxas (12.8) while the kernel-prewarm helpers
(megacpp/ops/kernel_prewarm.py), started after Inductor had pointed Triton at torch's (13.0), keyed theirs
with that one; the first backward found none of the helpers' kernels and compiled them again: 9.3-13.5 s
against 1.5-1.9 s with the pin, in cold `small` runs on an H200 (BENCHMARKS.md, C3).
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megacpp.compile.config import CompileConfig

TORCHRUN_DEFAULTS: dict[str, str] = {
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "7200",
}

PTXAS_VARIABLE = "TRITON_PTXAS_PATH"


def torch_ptxas(torch_dir: Path | None = None) -> Path | None:
    """The ptxas that ships with torch (``torch/bin/ptxas``), the one Inductor hands to Triton; None where the
    wheel has none (CPU wheels) or it is not executable."""
    ptxas = (Path(torch.__file__).parent if torch_dir is None else torch_dir) / "bin" / "ptxas"
    return ptxas if ptxas.is_file() and os.access(ptxas, os.X_OK) else None


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
    """Apply the Inductor autotune defaults, torch's ptxas for Triton and, under torchrun (LOCAL_RANK set), the
    NCCL defaults. ``process_group_timeout_s`` (the run's dist.init_timeout_s) is only reported."""
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
    if env.get(PTXAS_VARIABLE):
        report.kept[PTXAS_VARIABLE] = env[PTXAS_VARIABLE]
    elif (ptxas := torch_ptxas()) is not None:
        env[PTXAS_VARIABLE] = report.set[PTXAS_VARIABLE] = str(ptxas)
    # "asked" = the config or the user's own Inductor variable, which Inductor read at import.
    autotune = cfg.max_autotune or env.get("TORCHINDUCTOR_MAX_AUTOTUNE") == "1"
    autotune_gemm = autotune or env.get("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM") == "1"
    subprocess = cfg.autotune_subprocess or env.get("TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC") == "1"
    inductor_config.max_autotune = autotune
    inductor_config.max_autotune_gemm = autotune_gemm
    inductor_config.autotune_in_subproc = subprocess
    report.inductor = {"max_autotune": autotune, "max_autotune_gemm": autotune_gemm, "autotune_in_subproc": subprocess}
    return report
