"""Run `megacpp <args>` on this rank with test faults injected (the test-only hooks of the
multi-GPU tests). Usage under torchrun:

    launch.py [--fault KIND@RANK[:STEP]]... train --preset tiny ...

Faults (RANK is the global rank that misbehaves; STEP the training step it does so at):
  config@R          rank R starts with another optim.muon_lr
  nan@R:S           rank R's forward output turns NaN in step S (its own loss only)
  stall@R:S         rank R stops making progress in step S (sleeps)
  kill@R:S          rank R is killed with SIGKILL in step S
  slow_warmup@R:S   rank R spends S seconds more on its first step (as a slow compile would)
  interrupt@R:S     rank R raises KeyboardInterrupt before step S (every rank should use it)
  sigint_step@R:S   rank R gets SIGINT (as from Ctrl-C) as step S starts, before its forward
  sigint_eval@R:S   rank R gets SIGINT (as from Ctrl-C) in the evaluation after step S, after its first batch
  sigint_sample@R:T rank R gets SIGINT in the end-of-run sample, before its token T (T >= 2)
  ckpt_write@R      rank R fails to write its checkpoint shard (permission denied)
  loader@R          after a resume, rank R's loader is one step ahead
  drift@R:S         after step S, rank R's first MoE selection bias moves by 1e-3
  graph_break@R     rank R's FFN forward has a graph break
  expert_parallel@R rank R starts with dist.expert_parallel 1 (the others as given)
  strategy@R        rank R starts with dist.strategy fsdp (the others as given)
  router_nan@R:S    rank R's MoE router scores turn NaN from step S on
  skew@R            rank R's MoE selection biases start at +100 on the first half of the experts, so
                    every token is routed there (give it to every rank, and to a single process, alike)
"""
from __future__ import annotations

import os
import signal
import sys
import time


def parse(argv: list[str]) -> tuple[list[tuple[str, int, int]], list[str]]:
    """Leading ``--fault SPEC`` pairs, then the CLI arguments."""
    faults = []
    while argv[:1] == ["--fault"]:
        kind, _, where = argv[1].partition("@")
        rank, _, step = where.partition(":")
        faults.append((kind, int(rank), int(step or 0)))
        argv = argv[2:]
    return faults, argv


def install(kind: str, step: int, args: list[str]) -> list[str]:
    import torch

    from megacpp.train.loop import Trainer

    if kind == "config":
        return [*args, "--optim.muon_lr", "0.021"]
    if kind == "expert_parallel":
        return [*args, "--dist.expert_parallel", "1"]
    if kind == "strategy":
        return [*args, "--dist.strategy", "fsdp"]
    if kind == "router_nan":
        from megacpp.model.moe import MoE

        original_scores = MoE.router_scores
        steps_run = {"last": 0}
        original_step = Trainer.train_step

        def counting_step(self):
            steps_run["last"] = self.step + 1
            return original_step(self)

        def router_scores(self, x):
            scores = original_scores(self, x)
            return scores * float("nan") if steps_run["last"] >= step else scores

        Trainer.train_step = counting_step
        MoE.router_scores = router_scores
        return args
    if kind == "skew":
        from megacpp.model.moe import MoE

        original_reset = MoE.reset_parameters

        def reset_parameters(self):
            original_reset(self)
            self.expert_bias[: self.cfg.n_experts // 2] = 100.0

        MoE.reset_parameters = reset_parameters
        return args
    if kind == "slow_warmup":
        original_first = Trainer.train_step

        def slow_first_step(self):
            if self.step == 0:
                time.sleep(step)
            return original_first(self)

        Trainer.train_step = slow_first_step
        return args
    if kind in ("nan", "stall", "kill", "interrupt", "drift", "sigint_step"):
        original = Trainer.train_step

        def train_step(self):
            if self.step + 1 == step:  # the step about to run
                if kind == "stall":
                    time.sleep(3600)
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "interrupt":
                    raise KeyboardInterrupt
                if kind == "sigint_step":
                    os.kill(os.getpid(), signal.SIGINT)
                if kind == "nan":
                    block = next(b for b in self.model.blocks if b.kind == "M")
                    block.mixer.register_forward_hook(lambda _m, _a, out: out * float("nan"))
            loss = original(self)
            if kind == "drift" and self.step + 1 == step:
                moe = next(b.mixer for b in self.model.blocks if b.kind == "E")
                with torch.no_grad():
                    moe.expert_bias[0] += 1e-3
            return loss

        Trainer.train_step = train_step
    elif kind == "sigint_eval":
        from megacpp.train import loop

        steps_run = {"last": 0}
        original_step, original_evaluate = Trainer.train_step, loop.evaluate_bpb

        def counting_train_step(self):
            steps_run["last"] = self.step + 1
            return original_step(self)

        def evaluate_bpb(*a, stop, **kw):
            return original_evaluate(*a, stop=_sigint_on_call(stop, 2, steps_run["last"] == step), **kw)

        Trainer.train_step = counting_train_step
        loop.evaluate_bpb = evaluate_bpb
    elif kind == "sigint_sample":
        from megacpp.train import sample

        original_generate = sample.generate_tokens

        def generate_tokens(*a, stop, **kw):
            return original_generate(*a, stop=_sigint_on_call(stop, step, True), **kw)

        sample.generate_tokens = generate_tokens
    elif kind == "ckpt_write":
        from torch.distributed.checkpoint import FileSystemWriter

        def refuse(self, plan, planner):
            raise PermissionError(13, "Permission denied", str(self.path))

        FileSystemWriter.write_data = refuse
    elif kind == "loader":
        from megacpp.data.loader import PackedLoader

        original_load = PackedLoader.load_state_dict

        def load_state_dict(self, state, *a, **kw):
            original_load(self, state, *a, **kw)
            self.step += 1

        PackedLoader.load_state_dict = load_state_dict
    elif kind == "graph_break":
        from megacpp.model.ffn import FFN

        original_forward = FFN.forward

        def forward(self, *a, **kw):
            torch._dynamo.graph_break()
            return original_forward(self, *a, **kw)

        FFN.forward = forward
    else:
        raise SystemExit(f"unknown fault {kind!r}")
    return args


def _sigint_on_call(stop, call: int, armed: bool):
    """`stop` that first sends this process SIGINT on its `call`-th use (when `armed`): the trainer asks it
    before every evaluation batch or sampled token, so Ctrl-C lands in the middle of that work."""
    calls = 0

    def ask() -> bool:
        nonlocal calls
        calls += 1
        if armed and calls == call:
            os.kill(os.getpid(), signal.SIGINT)
        return stop()

    return ask


def main() -> int:
    faults, args = parse(sys.argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    for kind, fault_rank, step in faults:
        if fault_rank == rank:
            args = install(kind, step, args)
    from megacpp.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
