"""What a large run pays before its first step and at each checkpoint, outside the step itself.

    python benchmarks/tools/bench_run_start.py                       # nam52 cut to depth 12, 4.5 GiB of files
    python benchmarks/tools/bench_run_start.py --depth 52 --threads 1 --files-gib 8

1. Building the model (megacpp.runtime.model_build): `HybridLM` built on the CPU with --threads threads
   (torchrun gives each rank one), on the meta device (the modules alone), and on CUDA where there is one.
2. Rank 0 writing a checkpoint's weights (megacpp.runtime.checkpoint.write_local_files): fresh fp32
   tensors of 64 MiB, --files-gib / 2 in all, as a sharded run's gathered weights arrive.
3. Hashing a checkpoint's files: one file of weights and one file of moments per rank (--ranks),
   --files-gib in all, from the page cache (each is read once first): each file whole, one after another
   and side by side (formats 2 and 3), then every file's blocks side by side (format 4's digests).
   The files of 2 and 3 are written under --dir and removed after.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from megacpp.model.hybrid import HybridLM
from megacpp.presets import preset
from megacpp.runtime.checkpoint import HASH_BLOCK_BYTES, _sha256, _sha256_each, block_digests, write_local_files
from megacpp.runtime.model_build import build_model


def time_builds(depth: int, threads: int) -> None:
    cfg = preset("nam52").model
    cfg.depth, cfg.vocab_size = depth, 32768
    with torch.device("meta"):
        HybridLM(cfg)  # the first construction pays one-time imports and registrations
    torch.set_num_threads(threads)
    devices = [torch.device("cpu"), torch.device("meta")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    for device in devices:
        start = time.perf_counter()
        model = build_model(cfg, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters())
        print(f"build nam52 at depth {depth} ({params / 1e9:.2f}B parameters) on {device.type}"
              f"{f' with {threads} thread(s)' if device.type == 'cpu' else ''}: {seconds:.2f} s", flush=True)
        del model


def time_weights_file(gib: float, where: Path) -> None:
    state = {f"w{i}": torch.randn(16 << 20) for i in range(max(1, round(gib * 16)))}
    start = time.perf_counter()
    write_local_files(where, state, {"step": 0})
    seconds = time.perf_counter() - start
    print(f"write {len(state) / 16:.2f} GiB of weights (model.safetensors): {seconds:.2f} s", flush=True)
    (where / "model.safetensors").unlink()


def time_hashes(files_gib: float, ranks: int, where: Path) -> None:
    # the weights' file holds as much as the moments' files together, as for Muon's one fp32 momentum
    sizes = [files_gib / 2] + [files_gib / 2 / ranks] * ranks
    paths = [where / f"file{i}" for i in range(len(sizes))]
    for path, gib in zip(paths, sizes, strict=True):
        with path.open("wb") as f:
            for _ in range(max(1, round(gib * 16))):  # 64 MiB blocks
                f.write(os.urandom(64 << 20))
    [_sha256(p) for p in paths]  # into the page cache
    start = time.perf_counter()
    serial = [_sha256(p) for p in paths]
    middle = time.perf_counter()
    side_by_side = _sha256_each(paths)
    end = time.perf_counter()
    assert serial == side_by_side
    block_digests(paths)
    blocks = time.perf_counter() - end
    total = sum(p.stat().st_size for p in paths) / 2**30
    print(f"hash {len(paths)} files, {total:.1f} GiB, {os.cpu_count()} cores: one after another "
          f"{middle - start:.2f} s, side by side {end - middle:.2f} s (formats 2-3: each file whole), in "
          f"{HASH_BLOCK_BYTES >> 20} MiB blocks side by side {blocks:.2f} s (format 4)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=12, help="nam52's depth (a multiple of its 12-block pattern)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for the CPU build (torchrun: 1 per rank)")
    p.add_argument("--files-gib", type=float, default=4.5)
    p.add_argument("--ranks", type=int, default=4, help="moments files, one per rank")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the hashed files are written")
    args = p.parse_args()
    time_builds(args.depth, args.threads)
    where = Path(tempfile.mkdtemp(prefix="bench_run_start_", dir=args.dir))
    try:
        time_weights_file(args.files_gib / 2, where)
        time_hashes(args.files_gib, args.ranks, where)
    finally:
        shutil.rmtree(where)


if __name__ == "__main__":
    main()
