"""Cold compile time and step time of one optimizer's compiled step at a preset's shapes, in this
(fresh) process with empty Inductor and Triton caches; run once per variant:

    for v in landed stacked foreach; do PYTHONPATH=. python benchmarks/kernels/bench_optimizer_compile.py \\
        --preset small --optimizer muon --variant $v; done

Variants of Muon's elementwise stages (docs/decisions.md, "The optimizer step compiles in helper
processes"): ``landed`` (megacpp's, matrix by matrix), ``stacked`` (each bucket's gradients, buffers and
parameters stacked, one op per stage, written back with `_foreach_copy_`) and ``foreach`` (torch's
`_foreach_*` ops over each bucket). ``--eager`` runs the step uncompiled instead (AdamW: torch's fused
kernel), for the step time a compile has to beat. Prints one line: graph nodes, the first call (compile +
run), the median of 20 further calls, and a digest of the parameters after them.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

import megacpp.optim.muon as muon  # noqa: E402
from megacpp.config import apply_overrides  # noqa: E402
from megacpp.model.hybrid import HybridLM  # noqa: E402
from megacpp.optim.stack import build_optimizers  # noqa: E402
from megacpp.presets import preset  # noqa: E402


def _fp32(tensors: list[Tensor]) -> list[Tensor]:
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


def momentum_foreach(grads, buffers, momentum, nesterov, grad_scale=None):
    g = _fp32(grads)
    if grad_scale is not None:
        g = torch._foreach_mul(g, grad_scale)
    new = torch._foreach_lerp(_fp32(buffers), g, [(1 - momentum).float()] * len(g))
    torch._foreach_copy_(buffers, new)
    return torch._foreach_lerp(g, new, [momentum.float()] * len(g)) if nesterov else new


def apply_foreach(params, ortho, lr, weight_decay, plan, scale=None):
    keep = (1 - lr * weight_decay).float()
    u = _fp32(list(ortho.unbind(0)))
    if scale is not None:
        u = torch._foreach_mul(u, list(scale.unbind(0)))
    if plan.cautious:
        mask = torch._foreach_clamp_min(torch._foreach_sign(torch._foreach_mul(u, params)), 0.0)
        base = torch._foreach_mul(params, torch._foreach_add(torch._foreach_mul(mask, keep - 1), 1.0))
    else:
        base = torch._foreach_mul(params, keep)
    step = -(lr * plan.lr_ratio).float()
    torch._foreach_copy_(params, torch._foreach_addcmul(base, u, [step] * len(u)))


def momentum_stacked(grads, buffers, momentum, nesterov, grad_scale=None):
    g = torch.stack(grads).float()
    if grad_scale is not None:
        g = g * grad_scale
    new = torch.lerp(torch.stack(buffers).float(), g, (1 - momentum).float())
    torch._foreach_copy_(buffers, list(new.unbind(0)))
    return list((torch.lerp(g, new, momentum.float()) if nesterov else new).unbind(0))


def apply_stacked(params, ortho, lr, weight_decay, plan, scale=None):
    keep = (1 - lr * weight_decay).float()
    u = ortho.float() if scale is None else ortho.float() * scale
    p = torch.stack(params)
    factor = 1 + (keep - 1) * (u * p > 0) if plan.cautious else keep
    torch._foreach_copy_(params, list(torch.addcmul(p * factor, u, -(lr * plan.lr_ratio).float()).unbind(0)))


VARIANTS = {"landed": None, "stacked": (momentum_stacked, apply_stacked), "foreach": (momentum_foreach, apply_foreach)}


def _override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    parser.add_argument("--variant", choices=list(VARIANTS), default="landed")
    parser.add_argument("--eager", action="store_true", help="the uncompiled step (no graph)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=_override,
                        help="a preset override, e.g. model.depth=12")
    args = parser.parse_args()
    if VARIANTS[args.variant] is not None:
        muon.momentum_updates, muon.apply_update = VARIANTS[args.variant]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = apply_overrides(preset(args.preset), args.set)
    cfg.optim.compile_step = not args.eager
    torch.manual_seed(0)
    with torch.device(device):  # built in place: nam52's 6.8B parameters initialise in seconds on a GPU
        model = HybridLM(cfg.model)
    opt = build_optimizers(model, cfg.optim, total_steps=100, log=None).by_name[args.optimizer]
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.grad_scale = torch.tensor(0.9, device=device)
    nodes = []

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        nodes.append(len(gm.graph.nodes))
        return compile_fx(gm, example_inputs)

    opt.compile_backend = backend
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    started = time.perf_counter()
    opt.step()
    sync()
    first = time.perf_counter() - started
    times = []
    for _ in range(20):
        started = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - started)
    digest = sum(float(p.double().square().sum()) for p in model.parameters())
    variant = "eager" if args.eager else args.variant
    print(f"{args.preset} {args.optimizer} {variant}: graph nodes {nodes}, first call {first:.1f} s, "
          f"step {sorted(times)[10] * 1e3:.2f} ms, digest {digest:.10e}")


if __name__ == "__main__":
    main()
