"""On a CUDA machine: the training loop's host reads do not wait for the GPU's queue.

Pinned memory and CUDA events exist only on a GPU machine, so CPU CI deselects these (the `gpu` marker,
pyproject's addopts); on a GPU machine: ``python -m pytest -m gpu tests/test_gpu_host_syncs.py``.
"""
from __future__ import annotations

import pytest
import torch

from megacpp.data.config import DataConfig
from megacpp.data.loader import PackedLoader
from megacpp.data.prepare import prepare_data
from megacpp.train.readback import Readback

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda() -> torch.device:
    assert torch.cuda.is_available(), "the gpu tests run on a machine with a CUDA device"
    torch.manual_seed(0)
    return torch.device("cuda")


def test_tier1_readback_of_queued_cuda_values_equals_a_synchronous_read(cuda):
    """The copy is ordered behind the work that made the values: a large matmul queued ahead of it."""
    a = torch.randn(4096, 4096, device=cuda)
    b = a @ a
    values = {"norm": b.norm(), "rows": b[:5, 0], "count": torch.tensor(11, device=cuda), "lr": 0.5}
    read = Readback(values).result()
    assert read == {"norm": float(values["norm"]), "rows": values["rows"].tolist(), "count": 11.0, "lr": 0.5}


def test_tier1_pinned_loader_batches_arrive_without_a_synchronizing_copy(cuda, tmp_path):
    """Under set_sync_debug_mode("error") a synchronizing copy raises; the batches equal the CPU loader's."""
    corpus = tmp_path / "src"
    corpus.mkdir()
    for i in range(60):
        body = "".join(f"    int v{i}_{j} = {j} * {i};\n" for j in range(1 + i % 9))
        (corpus / f"f{i:02d}.cc").write_text(f"int f{i}() {{\n{body}    return 0;\n}}\n")
    data = prepare_data(DataConfig(corpus=[str(corpus)], val_fraction=0.25, vocab_size=512,
                                   cache_dir=str(tmp_path / "cache")), progress=False, log=None)
    on_gpu = PackedLoader(data.shards, 4, 32, seed=3, device="cuda", pin_memory=True)
    on_cpu = PackedLoader(data.shards, 4, 32, seed=3)
    torch.cuda.set_sync_debug_mode("error")
    try:
        batches = [next(on_gpu) for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for batch in batches:
        for a, b in zip(batch, next(on_cpu), strict=True):
            assert torch.equal(a.cpu(), b)
