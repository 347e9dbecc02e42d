"""Training-loop configuration."""
from __future__ import annotations

import re
from dataclasses import dataclass

from megacpp.model.registry import BLOCK_KINDS
from megacpp.rules import AT_LEAST_1, NON_NEGATIVE, SEED, ConfigSection, Interval, Keys

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass
class TrainConfig(ConfigSection):
    steps: int = 600
    # Wall-clock budget of the run in seconds (0 = none): the run evaluates, saves and ends at the first
    # step that finishes past it. Compilation, evaluations and checkpoints count; a resume continues it.
    time_budget_s: float = 0.0
    batch_size: int = 16  # sequences per rank per loader step; the global batch is ranks x this x grad_accum
    grad_accum: int = 1
    # Sequences per forward/backward: 0 = the whole batch_size; else a divisor of it, each batch then
    # runs as batch_size / micro_batch accumulated micro-batches (same rows, same loss, less memory).
    micro_batch: int = 0
    # CUDA: a run that runs out of memory in its first steps restarts itself with half the micro-batch
    # (megacpp.train.autofit.supervisor), down to oom_min_micro_batch. Ignored on CPU.
    oom_autofit: bool = True
    # Block kinds whose mixers recompute their activations in the backward instead of keeping them
    # (megacpp.train.recompute): "none", "all", or kinds such as "E" or "M,E". Auto-fit turns it to
    # "all" before it cuts the micro-batch below 2.
    recompute: str = "none"
    oom_min_micro_batch: int = 1
    # Fine-tuning: a checkpoint (or a run directory: its newest valid one) whose weights, model settings and
    # tokenizer this run starts from, with a fresh optimizer and schedule (megacpp.train.finetune).
    init_from: str | None = None
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    deterministic: bool = False  # bitwise mode: deterministic algorithms, no TF32, pinned autotune
    out_dir: str = "runs/tiny"
    overwrite: bool = False  # start over in an out_dir holding a run: its files move to previous-<time>/
    eval_every: int = 100
    # Validation batches per evaluation, each an optimizer step's rows (ranks x batch_size x grad_accum); 0 = the
    # whole validation split, the text the baselines beside the figure were measured on (a subset's figure
    # says which share of the split it covers).
    eval_batches: int = 0
    log_every: int = 1  # a JSON line per step is cheap, and the plot's moving average needs the points
    ckpt_every: int = 200
    keep_last: int = 3
    sample_tokens: int = 160
    sample_prompt: str = "#include <"
    sample_temperature: float = 0.8
    sample_top_k: int = 40
    tensorboard: bool = True
    # Profile this many steps after warmup, from step 10 where the run is long enough (megacpp.train.profile):
    # each rank's trace under <out_dir>/profile/ and its split of a step into compute, exposed collectives
    # and idle. 0 = off.
    profile_steps: int = 0
    # The first profiled step (at least 3: steps 1 and 2 compile). 0 = step 10, or as late as a short run allows.
    # Later windows for several GPUs: on 2 H200s one rank's host lagged in steps 10-12 and the profile's step
    # took 133 ms against the run's median 104 (BENCHMARKS.md V15).
    profile_from: int = 0

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {
            "steps": AT_LEAST_1,
            "seed": SEED,
            "time_budget_s": NON_NEGATIVE,  # 0 = no budget
            "batch_size": AT_LEAST_1,
            "grad_accum": AT_LEAST_1,
            "micro_batch": NON_NEGATIVE,  # 0 = the whole batch_size
            "oom_min_micro_batch": AT_LEAST_1,
            "eval_every": AT_LEAST_1,
            "eval_batches": NON_NEGATIVE,  # 0 = the whole validation split
            "log_every": AT_LEAST_1,
            "ckpt_every": AT_LEAST_1,
            "keep_last": AT_LEAST_1,
            "sample_tokens": NON_NEGATIVE,
            "sample_temperature": NON_NEGATIVE,  # 0 = greedy
            "sample_top_k": NON_NEGATIVE,  # 0 = all tokens
            "profile_steps": NON_NEGATIVE,  # 0 = off
            "profile_from": NON_NEGATIVE,  # 0 = automatic
        }

    def check(self, k: Keys) -> None:
        """train.device is auto, cpu, cuda or cuda:N (whether that device exists is checked when used).
        Every micro-batch of a batch has the same size: a ragged last one would weigh its tokens
        differently in the loss and compile another graph. train.recompute names block kinds the registry
        knows. Profiled steps come after the two warmup steps (megacpp.train.profile): a run too short
        to reach them would silently profile nothing."""
        if not _DEVICE.fullmatch(self.device):
            raise k.error("device", "must be auto, cpu, cuda or cuda:N")
        if self.micro_batch and self.batch_size % self.micro_batch:
            raise k.error_among(("micro_batch", "batch_size"),
                                "the micro-batch must divide train.batch_size (0 = the whole batch)")
        if self.oom_min_micro_batch > self.batch_size:
            raise k.error_among(("oom_min_micro_batch", "batch_size"),
                                "the smallest micro-batch auto-fit may try is larger than the batch it splits")
        try:
            recompute_kinds(self.recompute)
        except ValueError as exc:
            raise k.error("recompute", f"is not a recompute setting: {exc}") from None
        if self.profile_steps and self.steps < 2 + self.profile_steps:
            raise k.error_among(("profile_steps", "steps"), f"profiling {self.profile_steps} step(s) after the 2 "
                                f"warmup steps needs train.steps >= {2 + self.profile_steps}")
        if 0 < self.profile_from < 3:
            raise k.error("profile_from", "must be 0 (automatic) or at least 3: steps 1 and 2 compile")
        if self.profile_steps and self.profile_from and self.profile_from + self.profile_steps - 1 > self.steps:
            raise k.error_among(("profile_from", "profile_steps", "steps"),
                                f"profiling steps {self.profile_from}-{self.profile_from + self.profile_steps - 1} "
                                f"needs train.steps >= {self.profile_from + self.profile_steps - 1}")


def recompute_kinds(setting: str) -> frozenset[str]:
    """The block kinds a ``train.recompute`` setting names ("none", "all", or e.g. "M,E"); ValueError
    naming what is wrong otherwise."""
    value = setting.strip()
    if value == "none":
        return frozenset()
    if value == "all":
        return frozenset(BLOCK_KINDS)
    kinds = [part.strip() for part in value.split(",")]
    unknown = [kind for kind in kinds if kind not in BLOCK_KINDS]
    if unknown:
        raise ValueError(f"{setting!r}: expected 'none', 'all' or block kinds separated by commas, each one of "
                         f"{', '.join(BLOCK_KINDS)} (unknown: {', '.join(map(repr, unknown))})")
    return frozenset(kinds)
