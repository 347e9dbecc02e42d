"""The model is built where it runs (megacpp.runtime.model_build): on the CPU exactly as before, elsewhere
with every draw on that device and none from the CPU's generator (the minute `nam52` spent drawing its
weights on each rank's CPU). The CUDA side is tests/test_gpu_model_build.py."""
from __future__ import annotations

import torch

from megacpp.model.hybrid import HybridLM
from megacpp.presets import preset
from megacpp.runtime.model_build import build_model


def _model_config():
    cfg = preset("tiny").model
    cfg.vocab_size = 512
    return cfg


def test_tier1_built_on_the_cpu_it_is_the_model_built_plainly_bit_for_bit():
    torch.manual_seed(3)
    plain = HybridLM(_model_config()).state_dict()
    torch.manual_seed(3)
    built = build_model(_model_config(), torch.device("cpu")).state_dict()
    assert list(built) == list(plain)
    assert all(built[name].device.type == "cpu" and torch.equal(built[name], plain[name]) for name in plain)


def test_tier1_built_for_another_device_every_tensor_is_created_there_and_the_cpu_draws_nothing():
    before = torch.random.get_rng_state()
    model = build_model(_model_config(), torch.device("meta"))
    assert torch.equal(torch.random.get_rng_state(), before)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert tensors and {name for name, t in tensors.items() if t.device.type != "meta"} == set()
