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


def test_tier1_auto_is_off_on_the_cpu_and_in_bitwise_mode_and_says_why():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = CompileConfig(cudagraphs="auto")
    assert CompileConfig().cudagraphs == "off", "a new feature defaults off: the library's default path unchanged"
    assert decide_cudagraphs(auto, cuda) == (True, "on (auto: one CUDA process)")
    torch.use_deterministic_algorithms(True)
    try:
        assert decide_cudagraphs(auto, cuda) == (False, "off (auto: bitwise mode)")
        assert decide_cudagraphs(CompileConfig(cudagraphs="on"), cuda) == (True, "on (compile.cudagraphs on)")
    finally:
        torch.use_deterministic_algorithms(False)
    assert decide_cudagraphs(auto, cpu) == (False, "off (auto: needs a CUDA device (the model runs on cpu))")
    assert decide_cudagraphs(CompileConfig(cudagraphs="off"), cpu) == (False, "off (compile.cudagraphs off)")
    assert decide_cudagraphs(CompileConfig(mode="none", backend="eager", cudagraphs="auto"), cpu) == (
        False, "off (auto: needs regions compiled by the inductor backend and a CUDA device (the model runs on cpu))")


def test_tier1_on_where_graphs_cannot_run_names_what_is_missing():
    with pytest.raises(ConfigError, match=r"compile.cudagraphs = 'on' needs a CUDA device \(the model runs on cpu\) "
                                          r"\(use auto or off\)"):
        decide_cudagraphs(CompileConfig(cudagraphs="on"), torch.device("cpu"))


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

    devices = []
    monkeypatch.setattr(regions, "decide_cudagraphs", lambda cfg, device: devices.append(device) or (replay, "here"))
    monkeypatch.setattr(torch, "compile", record)
    handle = regions.compile_model(build_standin("AMERF"), CompileConfig(mode="blocks", cudagraphs="auto"))
    assert (handle.cudagraphs, handle.cudagraphs_why) == (replay, "here")
    assert calls == [mode] * len(handle.regions) and len(handle.regions) == 6  # five blocks and the loss
    with torch.device("meta"):  # a model built for another device (the model helpers') names it
        regions.compile_model(build_standin("AMERF"), CompileConfig(mode="blocks"), torch.device("cuda", 1))
    assert devices == [torch.device("cpu"), torch.device("cuda", 1)]


@pytest.mark.parametrize("replay", [True, False])
def test_tier1_the_model_helpers_compile_with_the_trainers_decision(tmp_path, small_corpus, monkeypatch, replay):
    """Inductor keys its cache by the setting, and a lone helper would decide for itself: each job carries
    the trainer's decision as on or off."""
    started = []

    class Started:
        def attach(self, blocks):
            pass

        def stop(self):
            pass

    def start(jobs, logs, suffix):
        started.append(jobs)
        return Started()

    monkeypatch.setattr(regions, "decide_cudagraphs", lambda cfg, device: (replay, "here"))
    monkeypatch.setattr(loop.ModelPrewarm, "start", start)
    cfg = tiny_train_config(tmp_path, small_corpus, **{"compile.mode": "blocks", "compile.backend": "eager",
                                                         "compile.model_helper": "on"})
    Trainer(cfg, log=lambda _: None, progress=False).close()
    assert len(started) == 1 and started[0]
    assert {job.compile.cudagraphs for job in started[0].values()} == {"on" if replay else "off"}


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


def test_tier1_graphs_that_do_not_replay_are_counted_in_the_log_after_the_first_step(tmp_path, small_corpus):
    from torch._dynamo.utils import counters

    lines = []
    trainer = Trainer(tiny_train_config(tmp_path, small_corpus, **{"train.steps": "2"}), log=lines.append,
                      progress=False)
    trainer.parallel.compiled.cudagraphs = True  # CPU: Inductor's count is set by hand below
    counters["inductor"]["cudagraph_skips"] = 3
    try:
        trainer.run()
    finally:
        counters["inductor"]["cudagraph_skips"] = 0
    said = [line for line in lines if line.startswith("CUDA graphs:")]
    assert said == ["CUDA graphs: 3 compiled graph(s) not replayed (they run kernel by kernel); "
                    "TORCH_LOGS=perf_hints names why"]


def test_tier1_on_with_the_device_left_auto_on_a_cpu_machine_stops_before_the_data_work(tmp_path, small_corpus,
                                                                                        monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("the data work started before the refusal")

    monkeypatch.setattr(loop, "build_data", no_data)
    cfg = tiny_train_config(tmp_path, small_corpus, **{"compile.mode": "blocks", "compile.cudagraphs": "on"})
    with pytest.raises(ConfigError, match=r"compile.cudagraphs = 'on' needs a CUDA device \(the model runs on cpu\)"):
        Trainer(cfg, log=lambda _: None, progress=False)
