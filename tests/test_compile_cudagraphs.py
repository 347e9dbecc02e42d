"""compile.cudagraphs: where the regions replay as CUDA graphs, the errors for `on` where they cannot, the
regions compiled for replay, and the trainer's one mark per optimizer step. The replay itself needs a GPU:
tests/test_gpu_cudagraphs.py."""
from __future__ import annotations

import pytest
import torch

from megacpp.compile import regions
from megacpp.compile.config import CompileConfig
from megacpp.compile.cudagraphs import decide_cudagraphs
from megacpp.config import ConfigError
from megacpp.run_config import load_config
from megacpp.train import loop
from megacpp.train.loop import Trainer
from tests.compile_fixtures.standin import build_standin
from tests.helpers import tiny_train_config

pytestmark = pytest.mark.usefixtures("isolated_dynamo")


def test_tier1_auto_is_off_on_a_cpu_model_and_says_why():
    model = build_standin("AMERF")
    assert decide_cudagraphs(CompileConfig(), model) == (False, "off (auto: needs a CUDA device (the model is on cpu))")
    assert decide_cudagraphs(CompileConfig(cudagraphs="off"), model) == (False, "off (compile.cudagraphs off)")
    assert decide_cudagraphs(CompileConfig(mode="none", backend="eager"), model) == (
        False, "off (auto: needs regions compiled by the inductor backend and a CUDA device (the model is on cpu))")


def test_tier1_on_where_graphs_cannot_run_names_what_is_missing():
    with pytest.raises(ConfigError, match=r"compile.cudagraphs = 'on' needs a CUDA device \(the model is on cpu\) "
                                          r"\(use auto or off\)"):
        decide_cudagraphs(CompileConfig(cudagraphs="on"), build_standin("AMERF"))


def test_tier1_the_gate_refuses_on_without_inductor_regions_or_on_the_cpu():
    with pytest.raises(ConfigError, match=r"--compile.cudagraphs: compile.cudagraphs = 'on' needs regions compiled "
                                          r"by the inductor backend, and this run has compile.mode 'none'"):
        load_config(preset_name="tiny", overrides=[("compile.cudagraphs", "on")])
    with pytest.raises(ConfigError, match=r"CUDA graphs need a CUDA device .*train.device = 'cpu'"):
        load_config(preset_name="tiny", overrides=[("compile.cudagraphs", "on"), ("compile.mode", "blocks"),
                                                   ("train.device", "cpu")])


@pytest.mark.parametrize("replay, mode", [(True, "reduce-overhead"), (False, None)])
def test_tier1_every_region_is_compiled_for_replay_exactly_when_decided(monkeypatch, replay, mode):
    calls = []

    def record(fn, **kwargs):
        calls.append(kwargs["mode"])
        return fn

    monkeypatch.setattr(regions, "decide_cudagraphs", lambda cfg, model: (replay, "decided here"))
    monkeypatch.setattr(torch, "compile", record)
    handle = regions.compile_model(build_standin("AMERF"), CompileConfig(mode="blocks"))
    assert (handle.cudagraphs, handle.cudagraphs_why) == (replay, "decided here")
    assert calls == [mode] * len(handle.regions) and len(handle.regions) == 6  # five blocks and the loss


def test_tier1_the_trainer_begins_one_graph_step_per_optimizer_step(tmp_path, small_corpus, monkeypatch):
    """Two micro-batches a step: the mark comes once per optimizer step, before its first forward (a mark
    between micro-batches would free the first one's gradients, which the graphs hold)."""
    events = []
    monkeypatch.setattr(loop, "begin_graph_step", lambda: events.append("mark"))
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "3", "train.micro_batch": "2"})
    trainer = Trainer(cfg, log=lambda _: None, progress=False)
    trainer.model.register_forward_pre_hook(lambda model, _: events.append("forward") if model.training else None)
    trainer.parallel.compiled.cudagraphs = True  # CPU: nothing replays, the loop's marks are what is tested
    trainer.run()
    assert events == ["mark", "forward", "forward"] * 3
