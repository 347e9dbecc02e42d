"""Extending megacpp: a block kind is its mixer module, its torch-free config module, one registry line and
one ModelConfig field; an optimizer is its module, its torch-free spec module and one registry line, plus an
OptimConfig field for a knob of its own.

The toys are test-local modules (tests/toy_block.py and toy_block_config.py, tests/toy_optimizer.py and
toy_optimizer_spec.py). What a developer would add to the package is added here by registration, nothing
in megacpp is edited: the registry lines with monkeypatch.setitem, the config fields as dataclass subclasses
that the starting point of `load_config` (`megacpp.run_config.Config`) is swapped for. Each toy trains two
steps on CPU through the real trainer (`megacpp.train.loop.train`), and the gate refuses its bad values
naming the TOML file and line.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from megacpp import run_config
from megacpp.config import Config, ConfigError
from megacpp.model.config import ModelConfig
from megacpp.model.hints import ParamHint
from megacpp.model.registry import BLOCK_KINDS, BlockKind
from megacpp.optim.config import OptimConfig
from megacpp.optim.registry import OPTIMIZERS
from megacpp.run_config import load_config
from megacpp.runtime.checkpoint import list_checkpoints, load_checkpoint
from megacpp.train.loop import train
from tests.helpers import tiny_overrides
from tests.toy_block import ToyMixer
from tests.toy_block_config import ToyConfig
from tests.toy_optimizer_spec import SIGN_SPEC

REPO = Path(__file__).resolve().parent.parent


@dataclass
class ToyModelConfig(ModelConfig):
    toy: ToyConfig = field(default_factory=ToyConfig)  # the block kind's one ModelConfig field


@dataclass
class SignOptimConfig(OptimConfig):
    sign_lr: float = 0.01  # the toy optimizer's one knob


@dataclass
class ExtendedConfig(Config):
    """What `Config()` builds once the two fields above are in the package."""

    model: ToyModelConfig = field(default_factory=ToyModelConfig)
    optim: SignOptimConfig = field(default_factory=SignOptimConfig)


class SignedToyMixer(ToyMixer):
    """The toy block with its up-projection hinted to the toy optimizer: how parameters reach an optimizer
    the default routes do not know."""

    param_hints = {"up.weight": ParamHint(optimizer="sign")}


def _register_block(monkeypatch, mixer_path: str) -> None:
    monkeypatch.setattr(run_config, "Config", ExtendedConfig)
    monkeypatch.setitem(BLOCK_KINDS, "T", BlockKind("T", "toy gated linear unit", "toy", mixer_path))


def _load(tmp_path, corpus, toml: str, **overrides: str):
    """`toml` as the run's file, with tiny_train_config's settings (but its depth) on the command line."""
    path = tmp_path / "run.toml"
    path.write_text(toml)
    settings = tiny_overrides(tmp_path, corpus, **{"train.steps": "2", "train.eval_every": "2",
                                                   "train.ckpt_every": "1", **overrides})
    del settings["model.depth"]
    return load_config(path=path, overrides=list(settings.items()))


def _refused(tmp_path, corpus, toml: str) -> str:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, corpus, toml)
    return str(err.value)


def _quiet(_msg: str) -> None:
    pass


def test_a_toy_block_kind_trains_and_its_bad_values_are_refused_with_file_and_line(tmp_path, small_corpus,
                                                                                   monkeypatch):
    _register_block(monkeypatch, "tests.toy_block:ToyMixer")
    cfg, sources = _load(tmp_path, small_corpus, '[model]\npattern = "AT"\ndepth = 2\n\n[model.toy]\nhidden = 24\n')
    assert sources.source("model.toy.hidden") == f"{tmp_path / 'run.toml'}:6"

    result = train(cfg, log=_quiet, progress=False)
    assert result.step == 2 and len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
    weights, _, meta = load_checkpoint(result.checkpoint)
    assert meta["config"]["model"]["toy"] == {"hidden": 24}
    assert weights["blocks.1.mixer.up.weight"].shape == (24, 32)
    assert weights["blocks.1.mixer.down.weight"].abs().sum() > 0  # initialised to zero: trained

    path = tmp_path / "run.toml"
    range_error = _refused(tmp_path, small_corpus, '[model]\npattern = "AT"\n\n[model.toy]\nhidden = 0\n')
    assert range_error == f"{path}:5: model.toy.hidden = 0 must be >= 1"
    rule_error = _refused(tmp_path, small_corpus, '[model]\npattern = "AT"\n\n[model.toy]\nhidden = 7\n')
    assert rule_error == f"{path}:5: model.toy.hidden = 7 must be even: half the rows gate the other half"
    # The kind's rules hold where the pattern builds it; its ranges hold everywhere.
    _load(tmp_path, small_corpus, '[model]\npattern = "AF"\n\n[model.toy]\nhidden = 7\n')
    assert _refused(tmp_path, small_corpus, '[model]\npattern = "AF"\n\n[model.toy]\nhidden = 0\n') == range_error
    # The constructor runs the same rule on a config built in Python.
    with pytest.raises(ConfigError, match=r"^ToyConfig.hidden = 7 must be even: half the rows gate the other half$"):
        ToyMixer(32, ToyConfig(hidden=7), 0)


def test_tier3_a_toy_optimizer_trains_its_parameters_and_its_bad_values_are_refused(tmp_path, small_corpus,
                                                                                   monkeypatch):
    """Sign descent moves each entry of its parameters by exactly lr or not at all (up to the fp32 rounding
    of w - lr, < 1e-6 at these weights): the step from the first checkpoint to the second is its own."""
    _register_block(monkeypatch, "tests.test_extending:SignedToyMixer")
    monkeypatch.setitem(OPTIMIZERS, "sign", SIGN_SPEC)
    toml = '[model]\npattern = "AT"\ndepth = 2\n\n[optim]\nsign_lr = 0.01\ndecay_frac = 0.0\n'
    cfg, _ = _load(tmp_path, small_corpus, toml)

    result = train(cfg, log=_quiet, progress=False)
    assert result.step == 2
    first, second = (load_checkpoint(ckpt)[0]["blocks.1.mixer.up.weight"] for ckpt in list_checkpoints(result.out_dir))
    moved = (second - first).abs()
    assert moved.max() > 0
    assert torch.all((moved < 1e-6) | ((moved - 0.01).abs() < 1e-6))

    path = tmp_path / "run.toml"
    error = _refused(tmp_path, small_corpus, '[model]\npattern = "AT"\n\n[optim]\nsign_lr = 2.0\n')
    assert error == f"{path}:5: optim.sign_lr = 2.0 must be in [0, 1]"


def test_the_toy_config_section_and_optimizer_spec_load_without_torch():
    """What the configuration composes (the section, the spec) loads no torch, so `megacpp config` does not
    either; the mixer and the optimizer class it names load torch only when a model or a stack is built."""
    code = ("import sys, tests.toy_block_config, tests.toy_optimizer_spec; loaded = 'torch' in sys.modules; "
            "tests.toy_optimizer_spec.SIGN_SPEC.optimizer; print(loaded, 'torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=REPO)
    assert result.stdout.split() == ["False", "True"]
