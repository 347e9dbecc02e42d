"""GPU compile defaults and the torchrun environment."""
from __future__ import annotations

import os

import pytest
import torch._inductor.config

from megacpp.compile.config import CompileConfig
from megacpp.compile.env import apply_env

NCCL = ("TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")


@pytest.fixture(autouse=True)
def restore(monkeypatch):
    for key in (*NCCL, "LOCAL_RANK", "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM",
                "TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC"):
        monkeypatch.setenv(key, "")  # records the original state, restored after the test
        monkeypatch.delenv(key)
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
    assert "process-group timeout 7200 s" in report.format()


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


