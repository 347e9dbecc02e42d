"""benchmarks/kernels/ab_mamba3_kernels.py: other versions of the Mamba-3 kernels' module stand in for the tree's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels"


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.syspath_prepend(str(KERNELS))
    import ab_mamba3_kernels
    return ab_mamba3_kernels


def test_tier1_a_variant_file_stands_in_for_the_trees_kernels_and_is_put_back(tool, tmp_path):
    from megacpp.ops import mamba3_triton

    path = tmp_path / "other.py"
    path.write_text("def fused_fwd(*args):\n    return 'other fwd'\n\ndef fused_bwd(*args):\n    return 'other bwd'\n")
    module = tool.load_variant("other", path)
    assert sys.modules["mamba3_variant_other"] is module
    tree = {attr: getattr(mamba3_triton, attr) for attr in tool.SWAPPED}
    try:
        tool.use({attr: getattr(module, attr) for attr in tool.SWAPPED})
        assert mamba3_triton.fused_fwd() == "other fwd"
        assert mamba3_triton.fused_bwd() == "other bwd"
    finally:
        tool.use(tree)
    assert mamba3_triton.fused_bwd is tree["fused_bwd"]
    assert mamba3_triton.fused_bwd is not module.fused_bwd


@pytest.mark.parametrize("spec", ["main", "=x.py", "main=does/not/exist.py"])
def test_tier1_a_variant_without_name_or_file_is_refused_by_name(tool, monkeypatch, spec):
    monkeypatch.setattr(sys, "argv", ["ab_mamba3_kernels.py", "--variant", spec])
    with pytest.raises(SystemExit, match="--variant expects NAME=FILE with an existing file") as caught:
        tool.main()
    assert repr(spec) in str(caught.value)


def test_tier1_only_all_zero_matrices_are_drawn_for_timing(monkeypatch):
    """benchmarks/kernels/timing.py's `randomize_zero_weights`, which the kernel benchmarks share."""
    import torch

    monkeypatch.syspath_prepend(str(KERNELS))
    from timing import randomize_zero_weights

    module = torch.nn.Module()
    module.zero = torch.nn.Parameter(torch.zeros(6, 5))
    module.set = torch.nn.Parameter(torch.ones(6, 5))
    module.norm = torch.nn.Parameter(torch.zeros(5))  # a vector stays as it is
    randomize_zero_weights(module, std=0.5)
    assert module.zero.count_nonzero() == 30 and 0.05 < module.zero.std().item() < 2.0
    assert torch.equal(module.set, torch.ones(6, 5))
    assert torch.equal(module.norm, torch.zeros(5))
