"""Issue 12's E, head and optimizer pieces on one GPU, in one process, at `small`'s shapes:

- E sublayer (MoE mixer, compiled, bf16 autocast) forward+backward: padded dispatch against the
  dropless grouped dispatch (target <= 3.3 ms; 4.6-4.9 before);
- the loss head (final norm, LM head, soft-cap, cross-entropy; `HybridLM.loss`) forward+backward,
  eager against its compiled `blocks`-mode region, with the peak memory each adds (target <= 11 ms);
- the optimizer step (grad clip, Muon, AdamW, schedule) on `small`'s parameter set: eager
  (`optim.compile_step=false`) against the default on CUDA (compiled) (target <= 15 ms; 34 before).

    python benchmarks/bench_throughput.py
    python benchmarks/bench_throughput.py --quick --threads 1   # CPU smoke run at toy sizes

CUDA events, warmup then the median of --iters runs (benchmarks/timing.py). Prints a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch
import torch._dynamo
from timing import fwd_bwd_ms, median_ms  # benchmarks/timing.py (the script's directory is on sys.path)

from megacpp.compile import CompileConfig, apply_policy, compile_model
from megacpp.compile.versions import supports
from megacpp.model.hybrid import HybridLM
from megacpp.model.moe import MoE
from megacpp.optim import build_optimizers
from megacpp.presets import preset

Row = tuple[str, float, float | None, str]  # name, ms, peak GiB added (or None), note


def graph_breaks() -> int:
    return len(torch._dynamo.utils.counters["graph_break"])


def peak_added_gib(step: Callable[[], None], device: torch.device) -> float | None:
    """Memory one call allocates beyond what was allocated before it, at its peak (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def bench_experts(cfg, d_model: int, b: int, t: int, iters: int, dev: torch.device) -> list[Row]:
    rows = []
    x = torch.randn(b, t, d_model, device=dev, requires_grad=True)
    modules = {}
    for dispatch in ("padded", "grouped"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        moe_cfg = dataclasses.replace(cfg.model.moe, dispatch=dispatch)
        moe = modules[dispatch] = MoE(d_model, moe_cfg, 0).to(dev)
        with torch.no_grad():  # the zero-initialised output projections would time GEMMs on zeros
            moe.w_down.normal_(std=d_model**-0.5)
            moe.shared_down.weight.normal_(std=d_model**-0.5)
        ms = fwd_bwd_ms(torch.compile(moe), x, iters=iters)
        note = f"graph breaks {graph_breaks()}, dropped {int(moe.overflow)} of {b * t * moe_cfg.top_k} assignments"
        rows.append((f"E sublayer fwd+bwd, {dispatch} dispatch, compiled", ms, None, note))
        print(f"{rows[-1][0]}: {ms:.2f} ms ({note})", flush=True)
    # Same weights, a capacity nothing overflows: the two dispatches compute the same rows in bf16.
    modules["padded"].cfg.capacity_factor = cfg.model.moe.n_experts / cfg.model.moe.top_k
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
        padded, grouped = (modules[k](x) for k in ("padded", "grouped"))
    rms = padded.float().square().mean().sqrt().item()
    diff = (padded.float() - grouped.float()).abs()
    print(f"E grouped vs padded without overflow: max |diff| {diff.max().item():.3e}, RMS diff "
          f"{diff.square().mean().sqrt().item():.3e}, output RMS {rms:.3e}", flush=True)
    return rows


def bench_head(model: HybridLM, b: int, t: int, iters: int, dev: torch.device) -> list[Row]:
    d, vocab = model.cfg.d_model, model.cfg.vocab_size
    h = torch.randn(b, t, d, device=dev, requires_grad=True)
    targets = torch.randint(0, vocab, (b, t), device=dev)
    doc_ids = (torch.arange(t, device=dev) // 512).expand(b, t).contiguous()
    rows = []
    for name in ("eager", "compiled region"):
        if name == "eager":
            loss_fn, note = (lambda *a: HybridLM.loss(model, *a)), ""
        else:  # the blocks-mode region, as training compiles it
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compile_model(model, CompileConfig(mode="blocks"))
            loss_fn, note = model.loss, "graph breaks {breaks}, "

        def step(fn=loss_fn) -> None:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = fn(h, targets, doc_ids)
            loss.backward()
            h.grad = None
            model.zero_grad(set_to_none=True)

        ms = median_ms(step, dev, warmup=3, iters=iters)
        peak = peak_added_gib(step, dev)
        note = note.format(breaks=graph_breaks()) + f"mtp_depth {model.cfg.mtp_depth}"
        rows.append((f"head fwd+bwd (norm, LM head, soft-cap, CE), {name}", ms, peak, note))
        print(f"{rows[-1][0]}: {ms:.2f} ms, peak +{peak} GiB ({note})", flush=True)
    return rows


def bench_optimizer(model: HybridLM, cfg, iters: int, dev: torch.device) -> list[Row]:
    gen = torch.Generator(device=dev).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=dev, generator=gen) * 1e-3
    rows = []
    for name, compile_step in (("eager (compile_step=false)", False), ("compiled (auto's choice on CUDA)", True)):
        torch._dynamo.reset()
        optim_cfg = dataclasses.replace(cfg.optim, compile_step=compile_step)
        stack = build_optimizers(model, optim_cfg, total_steps=10_000, log=None)
        t0 = time.perf_counter()
        stack.step()  # state allocation, and the compile for the compiled step
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        first = time.perf_counter() - t0
        ms = median_ms(stack.step, dev, warmup=3, iters=iters)
        parts = {kind: median_ms(opt.step, dev, warmup=1, iters=iters) for kind, opt in
                 (("muon", stack.muon), ("adamw", stack.adamw))}
        compiled = all(opt.compile_step for opt in stack.optimizers)
        note = (f"first step {first:.1f} s; Muon {parts['muon']:.2f} ms, AdamW {parts['adamw']:.2f} ms "
                f"alone; compiled={compiled}")
        rows.append((f"optimizer step, {name}", ms, None, note))
        print(f"{rows[-1][0]}: {ms:.2f} ms ({note})", flush=True)
    return rows


def shrink(cfg) -> None:
    """`small`'s block mix at toy widths, for a CPU smoke run of the script."""
    m = cfg.model
    m.vocab_size, m.d_model, m.depth = 512, 64, 12
    m.attention.n_heads, m.attention.n_kv_heads, m.attention.head_dim = 4, 2, 16
    m.mamba.d_state, m.mamba.head_dim, m.mamba.chunk_size = 8, 16, 16
    m.moe.n_experts, m.moe.expert_hidden = 4, 32
    m.rnn.n_heads, m.rnn.key_dim, m.rnn.value_dim = 2, 16, 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--parts", default="experts,head,optimizer")
    p.add_argument("--quick", action="store_true", help="toy sizes (a CPU smoke run of the script)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    apply_policy(CompileConfig())
    cfg = preset("small")
    cfg.model.vocab_size = cfg.data.vocab_size
    if args.quick:
        shrink(cfg)
        args.batch, args.seq, args.iters = 2, 64, 3
    parts = args.parts.split(",")
    rows: list[Row] = []
    if "experts" in parts:
        rows += bench_experts(cfg, cfg.model.d_model, args.batch, args.seq, args.iters, dev)
    if "head" in parts or "optimizer" in parts:
        torch.manual_seed(0)
        model = HybridLM(cfg.model).to(dev)
        n_params = sum(p.numel() for p in model.parameters())
        if "optimizer" in parts:  # before the head's compile_model replaces model.loss
            rows += bench_optimizer(model, cfg, args.iters, dev)
        if "head" in parts:
            rows += bench_head(model, args.batch, args.seq, args.iters, dev)
        print(f"small: {n_params / 1e6:.1f}M parameters", flush=True)

    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    sizes = "toy sizes (--quick)" if args.quick else "small's shapes"
    print(f"\n{where} | torch {torch.__version__} | {sizes}, B{args.batch} x T{args.seq}, bf16 autocast | "
          f"grouped_mm gate: {supports('grouped_mm')}")
    print(f"{'what':<66}{'ms':>9}{'peak +GiB':>11}  note")
    for name, ms, peak, note in rows:
        print(f"{name:<66}{ms:>9.2f}{'' if peak is None else f'{peak:.2f}':>11}  {note}")


if __name__ == "__main__":
    main()
