"""apply_policy: the six Dynamo lines (+ fail_on_recompile_limit_hit), read back, idempotent, loud."""
from __future__ import annotations

import pytest
import torch._dynamo

from megacpp.compile import policy
from megacpp.compile.config import CompileConfig
from megacpp.compile.policy import KNOBS, POLICY, Knob, PolicyError, apply_policy
from megacpp.versions import GATES, Gate


@pytest.fixture(autouse=True)
def restore_dynamo_config(monkeypatch):
    monkeypatch.setattr(policy, "_status", None)
    saved = {k.resolve(): getattr(torch._dynamo.config, k.resolve()) for k in KNOBS.values()}
    with torch._dynamo.config.patch(saved):
        yield


def test_sets_the_six_settings_and_they_read_back():
    torch._dynamo.config.recompile_limit = 8
    torch._dynamo.config.automatic_dynamic_shapes = True
    status = apply_policy()
    config = torch._dynamo.config
    assert config.capture_scalar_outputs is True
    assert config.recompile_limit == 64
    assert config.accumulated_recompile_limit == 256
    assert config.automatic_dynamic_shapes is False
    assert config.assume_static_by_default is True
    assert config.enable_compiler_collectives is False
    assert config.fail_on_recompile_limit_hit is True
    assert config.suppress_errors is False
    assert {s.key for s in status.settings} == set(POLICY) | {"fail_on_recompile_limit_hit"}
    # the legacy aliases see the same values
    assert config.cache_size_limit == 64 and config.accumulated_cache_size_limit == 256


def test_idempotent_and_status_report():
    torch._dynamo.config.recompile_limit = 8
    first = apply_policy()
    snapshot = {s.name: getattr(torch._dynamo.config, s.name) for s in first.settings}
    second = apply_policy()
    assert {s.name: getattr(torch._dynamo.config, s.name) for s in second.settings} == snapshot
    assert second.applications == 2
    text = first.format()
    assert "recompile_limit = 64  (was 8)" in text
    assert "automatic_dynamic_shapes = False" in text and "suppress_errors = False" in text
    assert "(was" not in second.format().split("recompile_limit", 1)[1].splitlines()[0]


def test_config_switch_for_recompile_limit_hit():
    apply_policy(CompileConfig(fail_on_recompile_limit_hit=False))
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False


def test_missing_setting_fails_loudly(monkeypatch):
    monkeypatch.setitem(KNOBS, "capture_scalar_outputs", Knob("capture_scalar_outputz"))
    with pytest.raises(PolicyError, match="capture_scalar_outputz"):
        apply_policy()


def test_name_follows_the_version_gate(monkeypatch):
    # before the gate the legacy name is written (on 2.13 it is an alias of the new one)
    monkeypatch.setitem(GATES, "recompile_limit_names", Gate("99.0", "a future rename"))
    status = apply_policy()
    names = {s.key: s.name for s in status.settings}
    assert names["recompile_limit"] == "cache_size_limit"
    assert names["accumulated_recompile_limit"] == "accumulated_cache_size_limit"
    assert torch._dynamo.config.recompile_limit == 64


def test_prepare_compile_sets_cache_env_and_policy(tmp_path, monkeypatch):
    import torch._functorch.config
    import torch._inductor.config

    from megacpp.compile.entry import prepare_compile

    for key in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        monkeypatch.setenv(key, "")  # records the original state, restored after the test
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCH_NCCL_ENABLE_MONITORING", "1")  # a user's choice: kept
    monkeypatch.setenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "")
    monkeypatch.delenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    with torch._inductor.config.patch(fx_graph_cache=False, max_autotune=True), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        status = prepare_compile(CompileConfig(cache_dir=str(tmp_path)))
        assert torch._inductor.config.fx_graph_cache and not torch._inductor.config.max_autotune
    text = status.format()
    assert f"inductor cache: {(tmp_path / 'inductor').resolve()} (argument)" in text
    assert "set TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=7200" in text and "kept user TORCH_NCCL_ENABLE_MONITORING=1" in text
    assert "recompile_limit = 64" in text
    assert torch._dynamo.config.recompile_limit == 64
