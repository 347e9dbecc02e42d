"""On a CUDA machine: the host reads of the training loop do not wait for the GPU's queue.

    python benchmarks/check_host_syncs.py

Checks, each printed as PASS or FAIL (exit status 1 on any FAIL):
- `Readback` of CUDA tensors queued behind a large matmul gives exactly what `float()` and `tolist()`
  give (the copy is ordered behind the work that made the values);
- pinned batches of the training loader arrive under `torch.cuda.set_sync_debug_mode("error")` (a
  synchronizing copy raises) and equal the CPU loader's batches.
The CPU test suite cannot run either: pinned memory and CUDA events exist only on a GPU machine.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from megacpp.data.config import DataConfig
from megacpp.data.loader import PackedLoader
from megacpp.data.prepare import prepare_data
from megacpp.train.readback import Readback


def readback_matches_a_synchronous_read(device: torch.device) -> bool:
    a = torch.randn(4096, 4096, device=device)
    b = a @ a  # queued work ahead of the copy
    values = {"norm": b.norm(), "rows": b[:5, 0], "count": torch.tensor(11, device=device), "lr": 0.5}
    read = Readback(values).result()
    return read == {"norm": float(values["norm"]), "rows": values["rows"].tolist(), "count": 11.0, "lr": 0.5}


def pinned_batches_need_no_sync(root: Path) -> bool:
    corpus = root / "src"
    corpus.mkdir()
    for i in range(60):
        body = "".join(f"    int v{i}_{j} = {j} * {i};\n" for j in range(1 + i % 9))
        (corpus / f"f{i:02d}.cc").write_text(f"int f{i}() {{\n{body}    return 0;\n}}\n")
    data = prepare_data(DataConfig(corpus=[str(corpus)], val_fraction=0.25, vocab_size=512,
                                   cache_dir=str(root / "cache")), progress=False, log=None)
    on_gpu = PackedLoader(data.shards, 4, 32, seed=3, device="cuda", pin_memory=True)
    on_cpu = PackedLoader(data.shards, 4, 32, seed=3)
    torch.cuda.set_sync_debug_mode("error")
    try:
        batches = [next(on_gpu) for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return all(torch.equal(a.cpu(), b) for batch in batches
               for a, b in zip(batch, next(on_cpu), strict=True))


def main() -> int:
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device: this check runs on a GPU machine")
        return 1
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            "Readback of queued CUDA values equals float() and tolist()":
                readback_matches_a_synchronous_read(torch.device("cuda")),
            "pinned loader batches arrive without a synchronizing copy": pinned_batches_need_no_sync(Path(tmp)),
        }
    for name, ok in results.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
