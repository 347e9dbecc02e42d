"""A trained model loaded from a checkpoint, for ``megacpp eval`` and ``megacpp sample``."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megacpp.config import Config
from megacpp.data.baselines import Baselines
from megacpp.data.corpus import discover_corpus
from megacpp.data.tokenizer import CodeTokenizer
from megacpp.model.hybrid import HybridLM
from megacpp.run_config import from_dict
from megacpp.runtime.checkpoint import load_checkpoint, resolve_checkpoint, saved_step_rows
from megacpp.runtime.cpp_syntax import Compiler, SyntaxReport, check_completions
from megacpp.runtime.data import DataBundle, build_data
from megacpp.runtime.device import resolve_device
from megacpp.runtime.evaluate import Evaluation, evaluate_bpb
from megacpp.runtime.generate import generate_tokens, stream_text
from megacpp.runtime.model_build import build_model
from megacpp.runtime.position_curve import PositionCurve, position_curve


@dataclass
class Session:
    model: HybridLM
    tokenizer: CodeTokenizer
    config: Config
    checkpoint: Path
    device: torch.device
    trained_data_key: str | None = None  # the corpus and tokenizer the run trained on (its loader's key)
    # Rows of the run's optimizer step over all its ranks (None: train.batch_size x train.grad_accum): a
    # validation batch here is the one training evaluated, so `--batches N` covers training's N batches.
    step_rows: int | None = None
    _data: DataBundle | None = field(default=None, repr=False)

    def prompt_ids(self, prompt: str) -> list[int]:
        """BOS + the prompt's tokens, of any length: a decode cache longer than attention's RoPE tables
        (model.attention.max_seq_len) computes the rows it needs."""
        return [self.tokenizer.bos_id, *self.tokenizer.encode(prompt)]

    def stream(self, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int
               ) -> Iterator[str]:
        """The prompt, then the generated text; ends early at the end of a document.

        Training separates documents by BOS alone (the loader never emits EOS), so the model ends a
        document by predicting BOS: either special token stops the sample.
        """
        ids = self.prompt_ids(prompt)
        yield prompt
        tokens = generate_tokens(self.model, ids, max_new_tokens, temperature, top_k, seed,
                                 stop_id={self.tokenizer.bos_id, self.tokenizer.eos_id})
        yield from stream_text(self.tokenizer, tokens)

    def data(self) -> DataBundle:
        """The checkpoint's data with its own tokenizer, built on first use."""
        if self._data is None:
            data_cfg = dataclasses.replace(self.config.data, tokenizer_path=str(self.checkpoint / "tokenizer.json"))
            train = self.config.train
            self._data = build_data(data_cfg, train.seed, train.batch_size, self.device,
                                    val_batch_size=self.step_rows or train.batch_size * train.grad_accum)
        return self._data

    def _micro_batch(self) -> int:
        """Rows per forward: the training's micro-batch (a validation batch holds a whole step's rows)."""
        return self.config.train.micro_batch or self.config.train.batch_size

    def data_changed(self) -> str | None:
        """A line saying the corpus is not the one the run trained on (its files changed since), or None."""
        now = self.data().shards.key
        if self.trained_data_key is None or now == self.trained_data_key:
            return None
        return (f"note: the corpus {self.config.data.corpus or 'torch/include'} changed since the run trained "
                f"(data {self.trained_data_key[:12]} then, {now[:12]} now): this is today's validation split, "
                "not the one the run was measured on")

    def evaluate(self, batches: int = 0) -> tuple[Evaluation, Baselines]:
        """Bits per byte on the whole validation split (or its first `batches` batches), and the baselines
        of the split."""
        data = self.data()
        return evaluate_bpb(self.model, data, self.device, batches, micro_batch=self._micro_batch()), data.baselines

    def position_curve(self, batches: int, context_window: int | None = None) -> PositionCurve:
        """Bits per byte by position in the document over the same batches as `evaluate`, in the training's
        micro-batches (a row of 65,536 tokens has logits of 8 GiB in fp32 at a 32K vocabulary); with
        `context_window`, each document read in windows of that many tokens."""
        return position_curve(self.model, self.data(), self.device, batches, self._micro_batch(), context_window)

    def cpp_syntax(self, n: int, compiler: Compiler, max_new_tokens: int, context: int, timeout_s: float
                   ) -> SyntaxReport:
        """The syntax check of `n` completed functions of the validation split, prompts of at most `context`
        tokens."""
        docs = discover_corpus(self.config.data).split("val")
        return check_completions(self.model, self.tokenizer, docs, n, compiler, context, max_new_tokens, timeout_s)


def load_session(path: str | Path, cfg: Config) -> Session:
    """Rebuild the model from the checkpoint's own config; the device comes from ``cfg.train.device``."""
    ckpt = resolve_checkpoint(path)
    device = resolve_device(cfg.train.device)
    model_state, train_state, meta = load_checkpoint(ckpt, map_location=device)
    saved = from_dict(meta["config"], source=f"{ckpt}/meta.json")
    config = dataclasses.replace(saved, train=dataclasses.replace(saved.train, device=cfg.train.device))
    model = build_model(config.model, device)
    model.load_state_dict(model_state)
    model.eval()
    tokenizer = CodeTokenizer.from_file(ckpt / "tokenizer.json")
    return Session(model, tokenizer, config, ckpt, device, train_state.get("loader", {}).get("data_key"),
                   saved_step_rows(meta, config.train.batch_size))
