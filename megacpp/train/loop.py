"""The training loop: data, model, optimizers, compile, checkpoints, evaluation, plot and sample."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from megacpp.compile import CompileHealth, bounds_for, compile_model, forbid_recompiles, prepare_compile
from megacpp.compile.versions import torch_version
from megacpp.config import Config, dump_toml, to_dict
from megacpp.errors import MegacppError
from megacpp.model.hybrid import IGNORE_INDEX, HybridLM
from megacpp.model.params import flops_per_token, parameter_table
from megacpp.train.checkpoint import (
    check_compatible,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megacpp.train.data_setup import DataBundle, build_data
from megacpp.train.determinism import configure_mode, rng_state, seed_everything, set_rng_state
from megacpp.train.metrics import MetricsLogger, plot_loss
from megacpp.train.runtime import (
    after_optimizer_step,
    autocast_context,
    build_optimizer_stack,
    peak_flops,
    resolve_device,
)
from megacpp.validate import validate_config


def _floats(values: dict[str, Any]) -> dict[str, float]:
    """Metric values as Python floats (0-D tensors are read once, when logged)."""
    return {k: float(v) for k, v in values.items()}


class NonFiniteLossError(MegacppError, RuntimeError):
    """Training produced a NaN or infinite loss; the last good checkpoint is left untouched."""


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    losses: list[float]
    val_bpb: float | None
    unigram_bpb: float
    checkpoint: Path | None
    sample: str


@torch.no_grad()
def evaluate_bpb(model: HybridLM, data: DataBundle, device: torch.device, max_batches: int) -> float:
    """Bits per byte on the validation split: summed NLL (nats) / ln 2 / UTF-8 bytes of the targets
    (special-token targets excluded from both).

    Runs eagerly (``force_eager``) so no-grad evaluation never compiles or recompiles a frame.
    """
    was_training = model.training
    model.eval()
    nats, n_bytes = 0.0, 0
    with torch.compiler.set_stance("force_eager"), autocast_context(device):
        for batch in data.val_batches(max_batches):
            logits = model(batch.inputs, doc_ids=batch.doc_ids)
            # Special-token targets (document ends) stand for no bytes: excluded from both sums.
            targets = batch.targets.masked_fill(batch.target_bytes == 0, IGNORE_INDEX)
            nats += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                    ignore_index=IGNORE_INDEX, reduction="sum").item()
            n_bytes += int(batch.target_bytes.sum())
    model.train(was_training)
    return nats / math.log(2) / max(n_bytes, 1)


def find_nonfinite_sublayer(model: HybridLM, x: torch.Tensor, doc_ids: torch.Tensor) -> str:
    """Re-run one batch eagerly and name the first sublayer whose output is not finite."""
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        h = model.embed(x, doc_ids)
        if not torch.isfinite(h).all():
            return "the embeddings"
        for i, block in enumerate(model.blocks):
            h = block(h, doc_ids)
            if not torch.isfinite(h).all():
                return f"sublayer {i} ({block.kind}: {type(block.mixer).__name__})"
    return "no sublayer in a re-run (the loss or backward overflowed)"


class Trainer:
    def __init__(self, cfg: Config, log=print, progress: bool = True) -> None:
        self.cfg = cfg
        self.log = log
        self.progress = progress
        tc = cfg.train
        # Configs built in Python never met load_config: fail on what the config alone can tell
        # before minutes of corpus and tokenizer work.
        validate_config(cfg)
        self.device = resolve_device(tc.device)
        self.mode = configure_mode(tc.deterministic)
        self.compile_status = prepare_compile(cfg.compile)  # cache dir, env, Dynamo policy: before any compile
        seed_everything(tc.seed)
        self.data = build_data(cfg.data, tc.seed, tc.batch_size, self.device, log, progress)
        cfg.model.vocab_size = self.data.tokenizer.vocab_size
        torch.manual_seed(tc.seed)  # model init draws from a fixed point, whatever the data step drew
        self.model = HybridLM(cfg.model).to(self.device)
        self.stack = build_optimizer_stack(self.model, cfg)
        self.health = CompileHealth(bounds_for(cfg.compile))
        self.health.attach(compile_model(self.model, cfg.compile))
        self.out_dir = Path(tc.out_dir)
        self.step = 0
        self.losses: list[float] = []

    # ---------------------------------------------------------------- state

    def meta(self) -> dict[str, Any]:
        return {"config": to_dict(self.cfg), "tokenizer_hash": self.data.tokenizer_hash,
                "determinism": self.mode, "torch": str(torch_version())}

    def save(self) -> Path:
        state = {"step": self.step, "optim": self.stack.state_dict(), "loader": self.data.loader.state_dict(),
                 "rng": rng_state(), "losses": torch.tensor(self.losses, dtype=torch.float64)}
        return save_checkpoint(self.out_dir, self.step, self.model.state_dict(), state, self.meta(),
                               self.cfg.train.keep_last, {"tokenizer.json": self.data.tokenizer_json()})

    def resume(self) -> Path | None:
        path = latest_valid_checkpoint(self.out_dir, warn=self.log)
        if path is None:
            self.log(f"no checkpoint under {self.out_dir}; starting from step 0")
            return None
        model_state, state, meta = load_checkpoint(path, map_location=self.device)
        check_compatible(meta, to_dict(self.cfg.model), self.data.tokenizer_hash, path)
        self.model.load_state_dict(model_state)
        self.stack.load_state_dict(state["optim"])
        self.data.loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.losses = state["losses"].tolist()
        self.log(f"resumed from {path} at step {self.step}")
        return path

    # ---------------------------------------------------------------- steps

    def train_step(self) -> float:
        tc = self.cfg.train
        total = torch.zeros((), device=self.device)
        last_batch = None
        for _ in range(tc.grad_accum):
            x, y, doc_ids = next(self.data.loader)
            with autocast_context(self.device):
                loss = self.model(x, y, doc_ids) / tc.grad_accum
            loss.backward()
            total += loss.detach()
            last_batch = (x, doc_ids)
        value = float(total.item())
        if not math.isfinite(value):
            where = find_nonfinite_sublayer(self.model, *last_batch)
            raise NonFiniteLossError(
                f"step {self.step + 1}: loss is {value}; first non-finite output at {where}. "
                f"The last good checkpoint under {self.out_dir / 'checkpoints'} is untouched."
            )
        self.stack.step()
        after_optimizer_step(self.model)
        self.stack.zero_grad()
        return value

    def run(self, resume: bool = False) -> TrainResult:
        cfg, tc = self.cfg, self.cfg.train
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.toml").write_text(dump_toml(cfg))
        if resume:
            self.resume()
        self.log(self.run_header())
        metrics = MetricsLogger(self.out_dir, tc.tensorboard, resume=resume)
        tokens_per_step = tc.batch_size * tc.grad_accum * cfg.data.seq_len
        flops = flops_per_token(self.model, cfg.data.seq_len)
        peak = peak_flops(self.device)
        val_bpb: float | None = None
        checkpoint: Path | None = None
        bar = tqdm(total=tc.steps, initial=self.step, disable=not self.progress, dynamic_ncols=True,
                   desc="train", unit="step")
        after_warmup = contextlib.ExitStack()
        try:
            t_last = time.perf_counter()
            warm = False
            while self.step < tc.steps:
                loss = self.train_step()
                self.step += 1
                if not warm:  # every compiled region has run once: from here a recompile is a regression
                    self.health.end_warmup()
                    self.health.check_bounds()
                    if cfg.compile.forbid_recompiles:
                        after_warmup.enter_context(forbid_recompiles())
                    warm = True
                self.losses.append(loss)
                now = time.perf_counter()
                tok_s = tokens_per_step / max(now - t_last, 1e-9)
                t_last = now
                record = {"loss": loss, "tok_per_s": tok_s, **_floats(self.stack.metrics)}
                postfix = {"loss": f"{loss:.3f}", "tok/s": f"{tok_s:,.0f}"}
                if peak:
                    record["mfu"] = flops * tok_s / peak
                    postfix["mfu"] = f"{100 * record['mfu']:.1f}%"
                if self.step % tc.log_every == 0 or self.step == tc.steps:
                    metrics.log(self.step, "train", record)
                if self.step % tc.eval_every == 0 or self.step == tc.steps:
                    val_bpb = evaluate_bpb(self.model, self.data, self.device, tc.eval_batches)
                    metrics.log(self.step, "val", {"val_bpb": val_bpb})
                if val_bpb is not None:
                    postfix["val_bpb"] = f"{val_bpb:.3f}"
                bar.set_postfix(postfix, refresh=False)
                bar.update(1)
                if self.step % tc.ckpt_every == 0 or self.step == tc.steps:
                    checkpoint = self.save()
        finally:
            after_warmup.close()
            bar.close()
            metrics.log(self.step, "compile", self.compile_summary())
            metrics.close()
            self.health.check_bounds()
            self.health.close()
        plot = plot_loss(metrics.path, self.out_dir / "loss.png", self.data.unigram_bpb)
        self.log(f"loss curve: {plot}")
        sample = self.sample_text()
        return TrainResult(self.out_dir, self.step, self.losses, val_bpb, self.data.unigram_bpb, checkpoint,
                           sample)

    def compile_summary(self) -> dict[str, float]:
        totals = self.health.totals()
        return {"graphs": totals.graphs, "graph_break_sites": len(self.health.break_sites()),
                "recompiles_after_warmup": totals.recompiles_after_warmup, "compile_time_s": totals.compile_time_s}

    def run_header(self) -> str:
        tc = self.cfg.train
        lines = [
            f"device {self.device}, mode {self.mode['mode']}, compile {self.cfg.compile.mode} "
            f"({self.cfg.compile.backend})",
            self.compile_status.format(),
            f"model {self.cfg.model.pattern} x depth {self.cfg.model.depth} ({self.model.layout}), "
            f"d_model {self.cfg.model.d_model}, vocab {self.cfg.model.vocab_size}",
            parameter_table(self.model),
            self.stack.routing_table,
            f"batch {tc.batch_size} x {tc.grad_accum} accum x {self.cfg.data.seq_len} tokens, {tc.steps} steps; "
            f"unigram entropy of the corpus: {self.data.unigram_bpb:.3f} bits/byte",
        ]
        return "\n".join(lines)

    def sample_text(self) -> str:
        from megacpp.infer.generate import generate_tokens, stream_text

        tc = self.cfg.train
        tok = self.data.tokenizer
        prompt = [tok.bos_id, *tok.encode(tc.sample_prompt)]
        self.model.eval()
        with torch.compiler.set_stance("force_eager"):
            pieces = list(stream_text(tok, generate_tokens(self.model, prompt, tc.sample_tokens,
                                                           tc.sample_temperature, tc.sample_top_k, tc.seed,
                                                           stop_id=tok.eos_id)))
        self.model.train()
        text = tc.sample_prompt + "".join(pieces)
        (self.out_dir / "sample.txt").write_text(text)
        self.log(f"--- sample ({tc.sample_tokens} tokens, temperature {tc.sample_temperature}, "
                 f"top-k {tc.sample_top_k}) ---\n{text}\n---")
        return text


def train(cfg: Config, resume: bool = False, log=print, progress: bool = True) -> TrainResult:
    return Trainer(cfg, log=log, progress=progress).run(resume=resume)
