"""GPU compile defaults and the torchrun environment."""
from __future__ import annotations

import os

import pytest
import torch._inductor.config

import megacpp.compile.env as compile_env
from megacpp.compile.config import CompileConfig
from megacpp.compile.env import PTXAS_VARIABLE, apply_env, torch_ptxas

NCCL = ("TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")


@pytest.fixture(autouse=True)
def restore(monkeypatch):
    for key in (*NCCL, "LOCAL_RANK", "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM",
                "TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC", PTXAS_VARIABLE):
        monkeypatch.setenv(key, "")  # records the original state, restored after the test
        monkeypatch.delenv(key)
    monkeypatch.setattr(compile_env, "torch_ptxas", lambda: None)  # a CPU wheel's torch: no ptxas of its own
    with torch._inductor.config.patch(max_autotune=True, max_autotune_gemm=True, autotune_in_subproc=True):
        yield


def test_no_torchrun_no_nccl_variables():
    report = apply_env()
    assert not report.under_torchrun and report.set == {} and report.kept == {}
    assert not any(key in os.environ for key in NCCL)


def test_torchrun_sets_nccl_defaults_and_reports_them(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    report = apply_env()
    assert report.under_torchrun
    assert report.set == {"TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "7200"}
    assert os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "7200"
    assert "set TORCH_NCCL_ENABLE_MONITORING=0" in report.format()


@pytest.mark.parametrize("timeout_s", [90.0, 7200.0, 1234.5])
def test_the_report_prints_the_configured_process_group_timeout(monkeypatch, timeout_s):
    """The group is created with dist.init_timeout_s; the report says that value, not a constant."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    lines = apply_env(process_group_timeout_s=timeout_s).format().splitlines()
    assert [line for line in lines if "process-group timeout" in line] == [
        f"  process-group timeout {timeout_s:g} s (dist.init_timeout_s)"]


def test_the_trainer_reports_its_dist_init_timeout_s(monkeypatch, tmp_path):
    """The training entry point hands its configured timeout to the report (stopped right after, before
    any process group or data work)."""
    from megacpp.compile import entry
    from megacpp.config import Config
    from megacpp.train import loop
    from megacpp.train.autofit.attempt import Attempt

    class Stop(Exception):
        pass

    reports: list[str] = []

    def prepare_and_record(*args, **kwargs):
        status = entry.prepare_compile(*args, **kwargs)
        reports.append(status.format())
        return status

    def stop(self, *_args):
        raise Stop

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(loop, "prepare_compile", prepare_and_record)
    monkeypatch.setattr(Attempt, "init_distributed", stop)
    cfg = Config()
    cfg.dist.init_timeout_s = 321.0
    cfg.compile.mode, cfg.compile.cache_dir = "none", str(tmp_path)
    with pytest.raises(Stop):
        loop.Trainer(cfg, log=lambda _line: None)
    assert "  process-group timeout 321 s (dist.init_timeout_s)" in reports[0].splitlines()


def test_no_timeout_line_when_the_timeout_is_not_known(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert "process-group timeout" not in apply_env().format()


def test_user_values_are_kept(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "600")
    report = apply_env()
    assert os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "600"
    assert report.kept == {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600"}
    assert report.set == {"TORCH_NCCL_ENABLE_MONITORING": "0"}


def test_an_explicit_environ_mapping_is_used_instead_of_os_environ():
    env = {"LOCAL_RANK": "1"}
    apply_env(environ=env)
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0"


def test_autotune_off_unless_asked_and_in_a_subprocess_when_on(monkeypatch):
    report = apply_env(CompileConfig())
    assert not torch._inductor.config.max_autotune and not torch._inductor.config.max_autotune_gemm
    assert torch._inductor.config.autotune_in_subproc
    assert report.inductor == {"max_autotune": False, "max_autotune_gemm": False, "autotune_in_subproc": True}
    apply_env(CompileConfig(max_autotune=True))
    assert torch._inductor.config.max_autotune and torch._inductor.config.autotune_in_subproc
    apply_env(CompileConfig(autotune_subprocess=False))
    assert not torch._inductor.config.autotune_in_subproc
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM", "1")  # the user's own switch counts as asking
    assert apply_env(CompileConfig()).inductor["max_autotune_gemm"] is True


def _executable(path, mode=0o755):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(mode)
    return path


def test_tier1_torch_ptxas_is_torch_bin_ptxas_when_executable(tmp_path):
    assert torch_ptxas(tmp_path) is None  # no bin/ptxas
    _executable(tmp_path / "bin" / "ptxas", mode=0o644)
    assert torch_ptxas(tmp_path) is None  # there, not executable
    (tmp_path / "bin" / "ptxas").chmod(0o755)
    assert torch_ptxas(tmp_path) == tmp_path / "bin" / "ptxas"


def test_tier1_triton_gets_torchs_ptxas_before_anything_compiles(monkeypatch, tmp_path):
    ptxas = _executable(tmp_path / "bin" / "ptxas")
    monkeypatch.setattr(compile_env, "torch_ptxas", lambda: ptxas)
    env: dict[str, str] = {}
    report = apply_env(environ=env)
    assert env == {PTXAS_VARIABLE: str(ptxas)}
    assert report.set == {PTXAS_VARIABLE: str(ptxas)} and report.kept == {}
    assert f"set {PTXAS_VARIABLE}={ptxas}" in report.format()


def test_tier1_a_users_ptxas_is_kept(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_env, "torch_ptxas", lambda: _executable(tmp_path / "bin" / "ptxas"))
    env = {PTXAS_VARIABLE: "/opt/cuda/bin/ptxas"}
    report = apply_env(environ=env)
    assert env == {PTXAS_VARIABLE: "/opt/cuda/bin/ptxas"}
    assert report.kept == {PTXAS_VARIABLE: "/opt/cuda/bin/ptxas"} and report.set == {}
