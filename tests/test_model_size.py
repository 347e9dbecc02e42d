"""The model-size gate (megacpp.runtime.model_size): a model whose weights cannot exist on this machine is
refused in one line, before any of them (or the data) is allocated."""
from __future__ import annotations

import pytest
import torch

from megacpp.cli import main
from megacpp.model.hybrid import HybridLM
from megacpp.presets import preset
from megacpp.runtime import model_size
from megacpp.runtime.model_size import ModelTooLarge, check_model_fits
from tests.helpers import tiny_train_args


def _tiny_model_cfg():
    cfg = preset("tiny")
    cfg.model.vocab_size = cfg.data.vocab_size
    return cfg.model


def test_tier1_a_model_larger_than_host_memory_is_refused_naming_its_largest_parameter(monkeypatch):
    model_cfg = _tiny_model_cfg()
    with torch.device("meta"):
        params = dict(HybridLM(model_cfg).named_parameters())
    weights = 4 * sum(p.numel() for p in params.values())
    largest = max(params, key=lambda name: params[name].numel())
    monkeypatch.setattr(model_size, "host_memory_bytes", lambda: weights - 1)
    with pytest.raises(ModelTooLarge) as err:
        check_model_fits(model_cfg, torch.device("cpu"))
    message = str(err.value)
    assert "of fp32 weights alone, more than the" in message and "this host" in message
    assert f"{largest} {tuple(params[largest].shape)}" in message
    monkeypatch.setattr(model_size, "host_memory_bytes", lambda: weights)  # exactly fits: accepted
    check_model_fits(model_cfg, torch.device("cpu"))
    monkeypatch.setattr(model_size, "host_memory_bytes", lambda: None)  # unknown memory: no claim made
    check_model_fits(model_cfg, torch.device("cpu"))


def test_tier1_train_with_a_size_typed_too_long_is_one_line_before_data_work(tmp_path, capsys):
    """`--model.ffn.hidden 100000000000` ended in an allocator traceback from nn.Linear; now exit 2 with
    one line, before the corpus is read (this corpus path does not exist: the data step never ran)."""
    out = tmp_path / "run"
    args = tiny_train_args(tmp_path, tmp_path / "no-such-corpus", **{"train.out_dir": str(out)})
    assert main([*args, "--model.ffn.hidden", "100000000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "config error: the model has" in err and "ffn.hidden" in err
