"""On a CUDA machine: training with the compiled regions replayed as CUDA graphs (compile.cudagraphs on).

CPU CI deselects these (the `gpu` marker); on a GPU machine: ``python -m pytest -m gpu tests/test_gpu_cudagraphs.py``.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from megacpp.train.loop import Trainer
from tests.helpers import tiny_train_config
from tests.test_train import _assert_same_training_state, _run, _run_killed_after_three

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("isolated_dynamo")]

REPLAYED = {"train.device": "cuda", "compile.mode": "blocks", "compile.cudagraphs": "on"}


@pytest.fixture(autouse=True)
def cuda():
    assert torch.cuda.is_available(), "the gpu tests run on a machine with a CUDA device"
    counters.clear()


def test_tier1_a_replayed_run_killed_and_resumed_equals_the_straight_run(tmp_path, small_corpus, monkeypatch):
    """The resumed run's first step runs the regions before their graphs are recorded, the straight run's
    the same step replayed: equal bit for bit, so replay changes no kernel's arithmetic."""
    straight = _run(tiny_train_config(tmp_path / "a", small_corpus, **REPLAYED))
    assert straight.parallel.compiled.cudagraphs
    assert counters["inductor"]["cudagraph_skips"] == 0, "every region replays"
    _run_killed_after_three(tiny_train_config(tmp_path / "b", small_corpus, **REPLAYED), monkeypatch)
    resumed = _run(tiny_train_config(tmp_path / "b", small_corpus, **REPLAYED), resume=True)
    _assert_same_training_state(straight, resumed)


def test_tier2_replayed_micro_batches_train_the_same_twice(tmp_path, small_corpus):
    """Two micro-batches a step share one generation of graphs (the first one's gradients stay alive)."""
    runs = [_run(tiny_train_config(tmp_path / name, small_corpus, **REPLAYED, **{"train.micro_batch": "2"}))
            for name in ("a", "b")]
    assert all(math.isfinite(loss) for loss in runs[0].losses) and len(runs[0].losses) == 6
    _assert_same_training_state(*runs)
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_tier1_auto_replays_one_cuda_process(tmp_path, small_corpus):
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.device": "cuda", "compile.mode": "blocks",
                                                         "compile.cudagraphs": "auto"})
    trainer = Trainer(cfg, log=lambda _: None, progress=False)
    assert (trainer.parallel.compiled.cudagraphs, trainer.parallel.compiled.cudagraphs_why) == (
        True, "on (auto: one CUDA process)")
