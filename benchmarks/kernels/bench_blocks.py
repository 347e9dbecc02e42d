"""Sublayer forward+backward time on a GPU: megacpp's M, A and E mixers, and mamba_ssm's Mamba3 layer
measured in the same run when it can be imported (PYTHONPATH pointing at a mamba_ssm 2.3.2 source).

    PYTHONPATH=.peers/mamba_src python benchmarks/kernels/bench_blocks.py --d-model 768 --batch 16 --seq 2048

bf16 autocast, CUDA events, warmup then the median of --iters runs. Prints a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import torch._dynamo
from timing import fwd_bwd_ms, graph_breaks  # benchmarks/kernels/timing.py (the script's directory is on sys.path)
from torch import nn

from megacpp.compile.cache import setup_inductor_cache
from megacpp.model.attention import Attention
from megacpp.model.attention_config import AttentionConfig
from megacpp.model.mamba3 import Mamba3
from megacpp.model.mamba3_config import Mamba3Config
from megacpp.model.mamba3_convert import config_to_mamba_ssm
from megacpp.model.moe import MoE
from megacpp.model.moe_config import MoEConfig
from megacpp.model.segments import Segments, document_segments


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    setup_inductor_cache()  # as `megacpp train` does: keyed by the ops' source, shared with training runs
    dev = torch.device("cuda")
    d, b, t = args.d_model, args.batch, args.seq
    x = torch.randn(b, t, d, device=dev, requires_grad=True)
    segments = document_segments((torch.arange(t, device=dev) // 512).expand(b, t).contiguous())  # 512-token docs
    mcfg = Mamba3Config(d_state=128, expand=2, head_dim=64, chunk_size=64)
    rows: list[tuple[str, float, str]] = []

    def run(name: str, module: nn.Module, docs: Segments | None, compiled: bool) -> None:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        module = module.to(dev)
        target = torch.compile(module) if compiled else module
        ms = fwd_bwd_ms(target, *((x,) if docs is None else (x, docs)), iters=args.iters)
        breaks = str(graph_breaks()) if compiled else "-"
        rows.append((name, ms, breaks))
        print(f"{name}: {ms:.2f} ms (graph breaks {breaks})", flush=True)

    torch.manual_seed(0)
    run("M megacpp Mamba3, eager", Mamba3(d, mcfg, 0), None, False)
    run("M megacpp Mamba3, compiled", Mamba3(d, mcfg, 0), None, True)
    run("M megacpp Mamba3, compiled, doc_ids", Mamba3(d, mcfg, 0), segments, True)
    bf16_scan = dataclasses.replace(mcfg, scan_matmuls="activation")
    run("M megacpp Mamba3, compiled, bf16 scan matmuls", Mamba3(d, bf16_scan, 0), None, True)
    try:
        from mamba_ssm.modules.mamba3 import Mamba3 as PeerMamba3

        peer = PeerMamba3(**config_to_mamba_ssm(d, mcfg), device=dev)
        run("M mamba_ssm 2.3.2 Mamba3 (Triton), eager", peer, None, False)
        run("M mamba_ssm 2.3.2 Mamba3 (Triton), compiled", peer, None, True)
    except Exception as exc:  # the peer is optional: say why it is missing
        print(f"mamba_ssm peer unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
    acfg = AttentionConfig(n_heads=6, n_kv_heads=2, head_dim=128)
    run("A attention (GQA 6/2 x 128), compiled", Attention(d, acfg, 0), None, True)
    run("A attention, compiled, doc_ids", Attention(d, acfg, 0), segments, True)
    for dispatch in ("padded", "grouped"):  # "auto", the default, is grouped here (CUDA, bf16 autocast)
        ecfg = MoEConfig(n_experts=16, top_k=2, expert_hidden=1024, shared_expert=True, dispatch=dispatch)
        run(f"E MoE (top-2 of 16 x 1024 + shared), {dispatch}, compiled", MoE(d, ecfg, 0), None, True)

    tokens = b * t
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | d_model {d}, B{b} x T{t}, bf16 autocast")
    width = max(len(name) for name, _, _ in rows) + 2
    print(f"{'sublayer, fwd+bwd':<{width}}{'ms':>9}{'Mtok/s':>9}{'breaks':>8}")
    for name, ms, breaks in rows:
        print(f"{name:<{width}}{ms:>9.2f}{tokens / ms / 1e3:>9.2f}{breaks:>8}")


if __name__ == "__main__":
    main()
