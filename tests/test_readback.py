"""The step figures' host copy: the same values `float()` and `tolist()` read, in the given order."""
import pytest
import torch

from megacpp.train.readback import Readback


def test_tier1_readback_gives_the_values_float_and_tolist_read_in_the_given_order():
    torch.manual_seed(0)
    norms = torch.rand(7) * 1e3
    values = {"lr_multiplier": 0.5, "grad_norm": torch.rand(()), "count": torch.tensor(3),
              "bf16": torch.randn((), dtype=torch.bfloat16), "blocks": norms}
    read = Readback(values).result()
    assert list(read) == list(values)
    assert read["lr_multiplier"] == 0.5
    assert read["grad_norm"] == float(values["grad_norm"])
    assert read["count"] == 3.0 and isinstance(read["count"], float)
    assert read["bf16"] == float(values["bf16"])
    assert read["blocks"] == norms.tolist()


def test_tier1_readback_refuses_a_matrix_naming_it():
    with pytest.raises(ValueError, match=r"grid has shape \(2, 3\)"):
        Readback({"grid": torch.zeros(2, 3)})

