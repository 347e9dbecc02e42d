"""Cold compile of `HybridLM.segments` (the batch's documents and attention-mask layout) at `small`'s shapes,
in this fresh process with an empty Inductor cache; prints the first call's time and the slowest Triton
kernels' compile times (from the compilation metrics of ``TORCH_TRACE``):

    PYTHONPATH=. python benchmarks/kernels/bench_segments_compile.py --part segments
    PYTHONPATH=. python benchmarks/kernels/bench_segments_compile.py --part segments --workers at-compile

``--part``: ``segments`` (documents and FlexAttention's block layout, what `small` builds on CUDA),
``documents`` (the document fields alone) or ``dense`` (documents and a dense mask). ``--workers``: ``ready``
starts Inductor's compile workers and waits for them first (as a run does, `compile.workers`);
``at-compile`` leaves them to the compile (Inductor's own behaviour). Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

TRACE = Path(tempfile.mkdtemp())
os.environ["TORCH_TRACE"] = str(TRACE)  # read when torch is imported

import torch  # noqa: E402

from megacpp.compile.cache import setup_inductor_cache  # noqa: E402
from megacpp.model.segments import document_segments, segments_of  # noqa: E402

PARTS = {
    "segments": lambda doc_ids, t: segments_of(doc_ids, t, doc_ids.device, "flex"),
    "documents": lambda doc_ids, t: document_segments(doc_ids),
    "dense": lambda doc_ids, t: segments_of(doc_ids, t, doc_ids.device, "dense"),
}


def packed_rows(batch: int, t: int, device: torch.device) -> torch.Tensor:
    """(batch, t) document ids of documents 50-899 tokens long, as a packed training batch."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(batch):
        ids: list[int] = []
        while len(ids) < t:
            ids += [len(set(ids))] * int(torch.randint(50, 900, (1,), generator=g))
        rows.append(ids[:t])
    return torch.tensor(rows, device=device)


def slowest_kernels(count: int) -> list[tuple[str, float]]:
    for path in TRACE.glob("*.log"):
        for line in path.read_text().splitlines():
            if '"compilation_metrics"' in line:
                metrics = json.loads(line[line.index("{"):])["compilation_metrics"]
                top = metrics.get("triton_kernel_compile_times_us") or []
                return [(name, us / 1e6) for name, us in (json.loads(top) if isinstance(top, str) else top)[:count]]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=sorted(PARTS), default="segments")
    parser.add_argument("--workers", choices=["ready", "at-compile"], default="ready")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    setup_inductor_cache(tempfile.mkdtemp())
    if args.workers == "ready":
        from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool

        maybe_warm_pool()
        AsyncCompile.wait_pool_ready(timeout=180)
    doc_ids = packed_rows(args.batch, args.seq, torch.device("cuda"))
    torch._dynamo.mark_dynamic(doc_ids, 0)  # as the training regions mark the batch axis
    compiled = torch.compile(PARTS[args.part])
    began = time.perf_counter()
    compiled(doc_ids, args.seq)
    torch.cuda.synchronize()
    print(f"{args.part}, workers {args.workers}: first call {time.perf_counter() - began:.1f} s")
    for name, seconds in slowest_kernels(4):
        print(f"  {seconds:5.2f} s  {name}")


if __name__ == "__main__":
    main()
