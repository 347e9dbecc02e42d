"""A preset's M and R sublayers at its shapes under the settings a preset chooses between: M with fp32 or
bf16 scan operands (`model.mamba.scan_matmuls`), each with the reference or the Triton scan
(`model.mamba.scan_kernel`), and R at value width 64 and 16. Each is one compiled `Block`, forward +
backward under bf16 autocast on 512-token documents, timed as `bench_throughput.py`'s sublayers are: the
median of --iters from an idle GPU, and with the host's cost hidden (`timing.device_ms`).

    PYTHONPATH=. python benchmarks/kernels/probe_mixer_settings.py                        # nam52, B4 x T4096
    PYTHONPATH=. python benchmarks/kernels/probe_mixer_settings.py --preset small --batch 16 --seq 2048

Rows print as they are measured; the table prints last (and --out FILE keeps it as JSON).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

# benchmarks/kernels/ (the script's directory is on sys.path)
from bench_throughput import compiled_block, documents
from timing import device_ms, fwd_bwd_ms, fwd_bwd_step

from megacpp.model.segments import document_segments
from megacpp.presets import PRESETS, preset

# (row, block kind, Mamba-3 settings, M2RNN settings)
CASES = [
    ("M fp32 operands, reference scan", "M", {"scan_matmuls": "fp32", "scan_kernel": "reference"}, {}),
    ("M bf16 operands, Triton scan", "M", {"scan_matmuls": "activation", "scan_kernel": "auto"}, {}),
    ("M bf16 operands, reference scan", "M", {"scan_matmuls": "activation", "scan_kernel": "reference"}, {}),
    ("M fp32 operands, Triton scan", "M", {"scan_matmuls": "fp32", "scan_kernel": "auto"}, {}),
    ("R value width 64", "R", {}, {"value_dim": 64}),
    ("R value width 16", "R", {}, {"value_dim": 16}),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="nam52", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    dev = torch.device("cuda")
    cfg = preset(args.preset).model
    x = torch.randn(args.batch, args.seq, cfg.d_model, device=dev, requires_grad=True)
    docs = document_segments(documents(args.batch, args.seq, dev))
    rows = []
    for label, kind, mamba, rnn in CASES:
        block_cfg = dataclasses.replace(cfg, mamba=dataclasses.replace(cfg.mamba, **mamba),
                                        rnn=dataclasses.replace(cfg.rnn, **rnn))
        started = time.perf_counter()
        try:
            compiled = compiled_block(kind, block_cfg, dev)
            ms = fwd_bwd_ms(compiled, x, docs, iters=args.iters)
            dev_ms = device_ms(fwd_bwd_step(compiled, x, docs), dev, warmup=1, iters=args.iters)
        except Exception as exc:  # one failing setting must not hide the others
            print(f"{label}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        rows.append({"case": label, "ms": ms, "device_ms": dev_ms, "first_s": time.perf_counter() - started})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{args.preset}, B{args.batch} x T{args.seq}")
    for r in rows:
        print(f"{r['case']:<36}{r['ms']:9.2f} ms   device {r['device_ms']:8.2f} ms")


if __name__ == "__main__":
    main()
