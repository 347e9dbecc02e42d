"""Issue 12's table on one GPU, in one process, at `small`'s shapes (another preset's with --preset),
with the anchors measured in the same run:

- anchors: nanochat d12 (dense, 286M; a fetched copy at .peers/nanochat) whole compiled training steps
  and its optimizer step alone; mamba_ssm 2.3.2's Mamba3 SISO layer (Triton; a source copy at
  .peers/mamba_src with its `__init__.py` emptied so only the kernels load), forward + backward;
- each sublayer kind of `small` as one compiled block (the default fast paths; M also with the
  reference scan), forward + backward;
- E sublayer: padded dispatch against the dropless grouped dispatch;
- the loss head (final norm, LM head, soft-cap, cross-entropy; `HybridLM.loss`), eager against its
  compiled `blocks`-mode region, with the peak memory each adds;
- the optimizer step (grad clip, Muon, AdamW, schedule) on `small`'s parameter set, eager against
  compiled (the default on CUDA), with its device time split into matmul kernels and the rest
  (torch.profiler, `timing.matmul_split`);
- whole `small` steps and the dense stand-in (`model.pattern=AF` on `small`, i.e. the `dense` preset:
  base learning rates for every kind): compiled blocks, random
  tokens in 512-token documents, forward + backward + optimizer, tokens/s and MFU (megacpp's FLOP
  convention, `megacpp.model.params.flops_per_token`, for both).

    PYTHONPATH=.:.peers/nanochat:.peers/mamba_src python benchmarks/kernels/bench_throughput.py
    python benchmarks/kernels/bench_throughput.py --quick --threads 1 --parts experts,head,optimizer   # CPU smoke run

CUDA events, warmup then the median of --iters runs (benchmarks/kernels/timing.py), each from an idle GPU; the
M sublayer and mamba_ssm's layer also with the host's cost hidden ("device time", `timing.device_ms`).
Every row prints when it is measured (a call cut by its time limit keeps them); the table with
megacpp/anchor ratios prints last.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch
import torch._dynamo

# benchmarks/kernels/timing.py (the script's directory is on sys.path)
from timing import device_ms, fwd_bwd_ms, fwd_bwd_step, matmul_split, median_ms, randomize_zero_weights

from megacpp.compile.cache import setup_inductor_cache
from megacpp.compile.config import CompileConfig
from megacpp.compile.cudagraphs import begin_graph_step
from megacpp.compile.policy import apply_policy
from megacpp.compile.regions import compile_model
from megacpp.config import apply_overrides
from megacpp.model.hints import run_after_optimizer_step
from megacpp.model.hybrid import Block, HybridLM
from megacpp.model.moe import MoE
from megacpp.model.params import flops_per_token
from megacpp.model.segments import document_segments
from megacpp.optim import build_optimizers
from megacpp.presets import PRESETS, dense_of, preset
from megacpp.runtime.device import peak_flops
from megacpp.versions import supports

Row = tuple[str, float, float | None, str]  # name, ms, peak GiB added (or None), note
# The M pair and E are timed twice: from an idle GPU, so a host that launches slower than the GPU runs
# shows (mamba_ssm's eager layer and E's many small kernels are host-bound on slower hosts), and with the
# host's cost hidden, as in a training step, whose host runs ahead of the GPU.
DEVICE_TIME_NOTE = "queued behind a GPU spin: the host's cost hidden (timing.device_ms)"

# row -> the anchor row it is compared with in the table
ANCHOR_OF = {
    "M sublayer fwd+bwd, compiled": "mamba_ssm Mamba3 SISO fwd+bwd, eager",
    "M sublayer fwd+bwd, compiled, reference scan": "mamba_ssm Mamba3 SISO fwd+bwd, eager",
    "M sublayer fwd+bwd, compiled, device time": "mamba_ssm Mamba3 SISO fwd+bwd, eager, device time",
    "optimizer step, compiled (auto's choice on CUDA)": "nanochat d12 optimizer step",
    "small whole step": "nanochat d12 whole step",
    "dense (small, pattern AF) whole step": "nanochat d12 whole step",
}


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
        randomize_zero_weights(moe, std=d_model**-0.5)
        compiled = torch.compile(moe)
        ms = fwd_bwd_ms(compiled, x, iters=iters)
        note = f"graph breaks {graph_breaks()}, dropped {int(moe.overflow)} of {b * t * moe_cfg.top_k} assignments"
        emit(rows, (f"E sublayer fwd+bwd, {dispatch} dispatch, compiled", ms, None, note))
        if dispatch == "grouped" and dev.type == "cuda":
            emit(rows, ("E sublayer fwd+bwd, grouped dispatch, compiled, device time",
                        device_ms(fwd_bwd_step(compiled, x), dev, warmup=1, iters=iters), None, DEVICE_TIME_NOTE))
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
    segments = document_segments((torch.arange(t, device=dev) // 512).expand(b, t).contiguous())
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
                loss = fn(h, targets, segments)
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
        parts = {kind: median_ms(opt.step, dev, warmup=1, iters=iters) for kind, opt in stack.by_name.items()}
        compiled = all(opt.compile_step for opt in stack.optimizers)
        alone = ", ".join(f"{kind} {part_ms:.2f} ms" for kind, part_ms in parts.items())
        device_ms, matmul_ms, kernels = matmul_split(stack.step, dev)
        split = f"profiled: {matmul_ms:.2f} of {device_ms:.2f} ms in matmul kernels, {kernels} kernels"
        note = f"first step {first:.1f} s; {alone} alone; {split}; compiled={compiled}"
        rows.append((f"optimizer step, {name}", ms, None, note))
        print(f"{rows[-1][0]}: {ms:.2f} ms ({note})", flush=True)
    return rows


def documents(b: int, t: int, dev: torch.device) -> torch.Tensor:
    return (torch.arange(t, device=dev) // 512).expand(b, t).contiguous()


def emit(rows: list[Row], row: Row) -> None:
    rows.append(row)
    peak = "" if row[2] is None else f", peak +{row[2]:.1f} GiB"
    print(f"{row[0]}: {row[1]:.2f} ms{peak} {row[3]}", flush=True)


def bench_nanochat(b: int, t: int, iters: int, dev: torch.device) -> list[Row]:
    try:
        from nanochat.gpt import GPT, GPTConfig
    except ImportError as exc:
        print(f"nanochat anchor unavailable ({exc}): put a copy at .peers/nanochat on PYTHONPATH", flush=True)
        return []
    rows: list[Row] = []
    with torch.device("meta"):
        model = GPT(GPTConfig(sequence_len=t))
    model.to_empty(device=dev)
    model.init_weights()
    opt = model.setup_optimizer()
    compiled = torch.compile(model, dynamic=False)
    idx, targets = (torch.randint(0, 32768, (b, t), device=dev) for _ in range(2))

    def train_step() -> None:
        compiled(idx, targets).backward()
        opt.step()
        model.zero_grad(set_to_none=True)

    train_step()
    compiled(idx, targets).backward()
    emit(rows, ("nanochat d12 optimizer step", median_ms(opt.step, dev, 3, iters), None, ""))
    model.zero_grad(set_to_none=True)
    ms = median_ms(train_step, dev, 3, iters)
    emit(rows, ("nanochat d12 whole step", ms, None, f"{b * t / ms * 1e3:,.0f} tok/s, compiled, SDPA"))
    return rows


def bench_mamba_ssm(cfg, b: int, t: int, iters: int, dev: torch.device) -> list[Row]:
    try:
        from mamba_ssm.modules.mamba3 import Mamba3 as PeerMamba3
    except ImportError as exc:
        print(f"mamba_ssm anchor unavailable ({exc}): put its source at .peers/mamba_src", flush=True)
        return []
    from megacpp.model.mamba3_convert import config_to_mamba_ssm

    rows: list[Row] = []
    torch.manual_seed(0)
    peer = PeerMamba3(**config_to_mamba_ssm(cfg.model.d_model, cfg.model.mamba), device=dev)
    x = torch.randn(b, t, cfg.model.d_model, device=dev, requires_grad=True)
    emit(rows, ("mamba_ssm Mamba3 SISO fwd+bwd, eager", fwd_bwd_ms(peer, x, warmup=3, iters=iters), None,
                "no document resets"))
    emit(rows, ("mamba_ssm Mamba3 SISO fwd+bwd, eager, device time",
                device_ms(fwd_bwd_step(peer, x), dev, warmup=1, iters=iters), None, DEVICE_TIME_NOTE))
    return rows


def compiled_block(kind: str, model_cfg, dev: torch.device) -> torch.nn.Module:
    """One sublayer of `kind` as `blocks` mode compiles it: fresh Dynamo state, seed 0, zero-initialised
    output projections randomised (so the backward reaches every weight)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(kind, model_cfg, 1).to(dev)
    randomize_zero_weights(block, std=0.02)
    return torch.compile(block)


def bench_sublayers(cfg, b: int, t: int, iters: int, dev: torch.device) -> list[Row]:
    """Each kind of `small`'s sublayers as one compiled block, as `blocks` mode compiles it."""
    rows: list[Row] = []
    x = torch.randn(b, t, cfg.model.d_model, device=dev, requires_grad=True)
    docs = document_segments(documents(b, t, dev))
    cases = [("A", "", {}), ("M", "", {}), ("M", ", reference scan", {"scan_kernel": "reference"}),
             ("E", "", {}), ("F", "", {}), ("R", "", {})]
    for kind, label, mamba_changes in cases:
        model_cfg = dataclasses.replace(cfg.model, mamba=dataclasses.replace(cfg.model.mamba, **mamba_changes))
        try:
            compiled = compiled_block(kind, model_cfg, dev)
            ms = fwd_bwd_ms(compiled, x, docs, iters=iters)
        except Exception as exc:  # one failing variant must not hide the others
            print(f"{kind}{label}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        emit(rows, (f"{kind} sublayer fwd+bwd, compiled{label}", ms, None, "512-token documents"))
        if kind in ("M", "E") and not label and dev.type == "cuda":
            emit(rows, (f"{kind} sublayer fwd+bwd, compiled, device time",
                        device_ms(fwd_bwd_step(compiled, x, docs), dev, warmup=1, iters=iters), None,
                        DEVICE_TIME_NOTE))
    return rows


def bench_whole_steps(cfg, label: str, b: int, t: int, iters: int, dev: torch.device) -> list[Row]:
    """Whole training steps (forward, backward, optimizer) of the model compiled as training does."""
    rows: list[Row] = []
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = HybridLM(cfg.model).to(dev)
    compile_model(model, cfg.compile)  # in place: the regions of cfg.compile.mode
    stack = build_optimizers(model, cfg.optim, total_steps=10_000, log=None)
    idx, targets = (torch.randint(0, cfg.model.vocab_size, (b, t), device=dev) for _ in range(2))
    docs = documents(b, t, dev)

    def train_step() -> None:
        begin_graph_step()  # as the trainer does: replayed regions (compile.cudagraphs) start a generation here
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(idx, targets, docs)
        loss.backward()
        stack.step()
        run_after_optimizer_step(model)
        stack.zero_grad()

    t0 = time.perf_counter()
    train_step()
    torch.cuda.synchronize(dev)
    first = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats(dev)
    ms = median_ms(train_step, dev, 3, iters)
    tok_s = b * t / ms * 1e3
    peak = peak_flops(dev)
    mfu = f"MFU {100 * tok_s * flops_per_token(model, t) / peak:.1f}%" if peak else "MFU n/a"
    emit(rows, (f"{label} whole step", ms, None,
                f"{tok_s:,.0f} tok/s, {mfu}, first step {first:.0f} s, "
                f"peak {torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB"))
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
    p.add_argument("--preset", default="small", choices=sorted(PRESETS),
                   help="whose shapes every megacpp row takes (the anchors keep theirs); default small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--parts", default="anchors,sublayers,experts,head,optimizer,small,dense",
                   help="comma-separated subset of the default, measured in the order given "
                   "(also nanochat or mamba_ssm: one of the two anchors)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every megacpp row, e.g. --set model.mamba.scan_kernel=reference")
    p.add_argument("--quick", action="store_true", help="toy sizes (a CPU smoke run of the script)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads")
    args = p.parse_args()
    setup_inductor_cache()  # as `megacpp train` does: keyed by the ops' source, shared with training runs
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    apply_policy(CompileConfig())
    cfg = apply_overrides(preset(args.preset), [tuple(kv.split("=", 1)) for kv in args.set])
    cfg.model.vocab_size = cfg.data.vocab_size
    if args.quick:
        shrink(cfg)
        args.batch, args.seq, args.iters = 2, 64, 3
    rows: list[Row] = []

    def head_and_optimizer(parts: set[str]) -> list[Row]:
        torch.manual_seed(0)
        model = HybridLM(cfg.model).to(dev)
        found = []
        if "optimizer" in parts:  # before the head's compile_model replaces model.loss
            found += bench_optimizer(model, cfg, args.iters, dev)
        if "head" in parts:
            found += bench_head(model, args.batch, args.seq, args.iters, dev)
        print(f"{args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
        return found

    dense = dense_of(cfg)
    measure = {
        "anchors": lambda: bench_nanochat(args.batch, args.seq, args.iters, dev)
        + bench_mamba_ssm(cfg, args.batch, args.seq, args.iters, dev),
        "nanochat": lambda: bench_nanochat(args.batch, args.seq, args.iters, dev),
        "mamba_ssm": lambda: bench_mamba_ssm(cfg, args.batch, args.seq, args.iters, dev),
        "sublayers": lambda: bench_sublayers(cfg, args.batch, args.seq, args.iters, dev),
        "experts": lambda: bench_experts(cfg, cfg.model.d_model, args.batch, args.seq, args.iters, dev),
        "optimizer": lambda: head_and_optimizer({"optimizer"}),
        "head": lambda: head_and_optimizer({"head"}),
        "small": lambda: bench_whole_steps(cfg, args.preset, args.batch, args.seq, args.iters, dev),
        "dense": lambda: bench_whole_steps(dense, f"dense ({args.preset}, pattern AF)", args.batch, args.seq,
                                           args.iters, dev),
    }
    for part in args.parts.split(","):  # in the order given: the first parts survive a cut-off call
        rows += measure[part]()
        torch.cuda.empty_cache()

    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    sizes = "toy sizes (--quick)" if args.quick else f"{args.preset}'s shapes"
    print(f"\n{where} | torch {torch.__version__} | {sizes}, B{args.batch} x T{args.seq}, bf16 autocast | "
          f"grouped_mm gate: {supports('grouped_mm')}")
    ms_of = {name: ms for name, ms, _, _ in rows}
    print(f"{'what':<66}{'ms':>9}{'vs anchor':>11}{'peak +GiB':>11}  note")
    for name, ms, peak, note in rows:
        anchor = ms_of.get(ANCHOR_OF.get(name, ""))
        ratio = f"{ms / anchor:.2f}x" if anchor else ""
        print(f"{name:<66}{ms:>9.2f}{ratio:>11}{'' if peak is None else f'{peak:.2f}':>11}  {note}")


if __name__ == "__main__":
    main()
