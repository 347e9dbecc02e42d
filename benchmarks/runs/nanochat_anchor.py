"""The data-parallel anchor: nanochat d12 trained on random tokens under torchrun, one job per GPU count.

nanochat keeps its parameters replicated and reduces the gradients inside its optimizer (no DDP wrapper),
the layout megacpp's `replicate` strategy is measured against (issue 33). Each step is timed as nanochat's
own training loop times it (from the end of one step to the end of the next, the host waiting for the
device every step), on nanochat's model, optimizer and compile call imported from a fetched copy.

    PYTHONPATH=.peers/nanochat torchrun --standalone --nproc-per-node 2 benchmarks/runs/nanochat_anchor.py \\
        --out /tmp/nanochat-2.json

Rank 0 writes one JSON object: GPUs, batch, sequence length, each step's seconds and loss, peak memory
and MFU in nanochat's convention (its `estimate_flops` per token over its peak-FLOPs table).
`bench_dist.py` runs it for its ``nanochat-N[-bB]`` variants.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="sequences per GPU per step (default 16, as small)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True, help="the JSON file rank 0 writes")
    args = p.parse_args()
    try:
        from nanochat.common import compute_cleanup, compute_init, get_peak_flops
        from nanochat.gpt import GPT, GPTConfig
    except ImportError as exc:
        raise SystemExit(f"nanochat is not importable ({exc}): fetch it to .peers/nanochat and put that "
                         "folder on PYTHONPATH") from None

    _, rank, _, world, device = compute_init("cuda")
    with torch.device("meta"):
        model = GPT(GPTConfig(sequence_len=args.seq))
    model.to_empty(device=device)
    model.init_weights()
    optimizer = model.setup_optimizer()
    compiled = torch.compile(model, dynamic=False)
    vocab = model.config.vocab_size
    generator = torch.Generator(device=device).manual_seed(1234 + rank)  # each rank its own batches

    step_s, losses = [], []
    torch.cuda.synchronize()
    last = time.perf_counter()
    for _ in range(args.steps):
        inputs, targets = (torch.randint(0, vocab, (args.batch, args.seq), device=device, generator=generator)
                           for _ in range(2))
        loss = compiled(inputs, targets)
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the host waits here, as nanochat's loop does when it logs each step
        now = time.perf_counter()
        step_s.append(now - last)
        last = now

    if rank == 0:
        flops_per_token = model.estimate_flops()
        peak = get_peak_flops(torch.cuda.get_device_name(device))
        late = sorted(step_s[len(step_s) // 2:])
        median = late[len(late) // 2]
        result = {
            "gpus": world, "batch": args.batch, "seq": args.seq, "step_s": step_s, "losses": losses,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "mfu": flops_per_token * args.batch * args.seq / median / peak,
            "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        }
        Path(args.out).write_text(json.dumps(result))
        print(f"nanochat d12 on {world} GPU(s): median step {1000 * median:.1f} ms, "
              f"{args.batch * args.seq / median:,.0f} tok/s per GPU", flush=True)
    compute_cleanup()


if __name__ == "__main__":
    main()
