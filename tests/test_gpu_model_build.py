"""On a CUDA machine: the model built for the GPU draws its weights there (the CPU's generator untouched),
and the same seed gives the same weights bit for bit, as every rank of a job needs. Run with
`python -m pytest -m gpu tests/test_gpu_model_build.py`."""
from __future__ import annotations

import pytest
import torch

from megacpp.presets import preset
from megacpp.runtime.model_build import build_model

pytestmark = pytest.mark.gpu


def test_tier2_built_on_the_gpu_from_one_seed_twice_the_weights_are_equal_and_the_cpu_drew_nothing():
    cfg = preset("small").model
    cfg.vocab_size = 4096
    device = torch.device("cuda")
    states = []
    for _ in range(2):
        torch.manual_seed(11)
        cpu_generator = torch.random.get_rng_state()
        states.append(build_model(cfg, device).state_dict())
        assert torch.equal(torch.random.get_rng_state(), cpu_generator)
    assert all(t.device.type == "cuda" for t in states[0].values())
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])
