"""Distributed Muon is Muon: the sharded update equals the single-device one (torchrun, gloo, CPU)."""
import pytest

from tests.torchrun import torchrun


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_tier1_sharded_muon_equals_single_device_muon(nproc: int) -> None:
    """Bitwise: parameters, momentum and second moments after 4 steps, on 2 and 3 ranks (uneven
    shards, fewer matrices than ranks). Breaks if a 2-D matrix is orthogonalized per shard, if the
    variance-reduction state is updated from partial rows, or if rows return to the wrong rank."""
    launch = torchrun(["tests/distributed/muon_parity.py"], nproc=nproc, timeout=240).check()
    assert launch.output.count("PASS") == nproc


@pytest.mark.slow
def test_tier1_sharded_muon_with_bf16_momentum_equals_single_device_muon() -> None:
    """Bitwise, as above, with the momentum stored in bf16 on both sides (optim.momentum_dtype): the
    rounding is elementwise, so each rank's rows round as the whole buffer's do."""
    launch = torchrun(["tests/distributed/muon_parity.py", "--momentum-dtype", "bfloat16"], nproc=2,
                      timeout=240).check()
    assert launch.output.count("PASS") == 2


@pytest.mark.slow
def test_tier1_compiled_sharded_step_equals_eager_and_never_recompiles_as_lr_moves() -> None:
    launch = torchrun(["tests/distributed/muon_parity.py", "--compile-backend", "aot_eager"], timeout=400).check()
    assert launch.output.count("PASS") == 2 and launch.output.count("none after") == 2
