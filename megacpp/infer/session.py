"""A trained model loaded from a checkpoint, for ``megacpp eval`` and ``megacpp sample``."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megacpp.config import Config
from megacpp.data.baselines import Baselines
from megacpp.data.tokenizer import CodeTokenizer
from megacpp.model.hybrid import HybridLM
from megacpp.run_config import from_dict
from megacpp.runtime.checkpoint import (
    CKPT_DIR_RE,
    CheckpointError,
    checkpoint_root,
    latest_valid_checkpoint,
    load_checkpoint,
)
from megacpp.runtime.data import build_data
from megacpp.runtime.device import resolve_device
from megacpp.runtime.evaluate import evaluate_bpb
from megacpp.runtime.generate import generate_tokens, stream_text


@dataclass
class Session:
    model: HybridLM
    tokenizer: CodeTokenizer
    config: Config
    checkpoint: Path
    device: torch.device

    def prompt_ids(self, prompt: str) -> list[int]:
        """BOS + the prompt's tokens. Any length decodes: attention's decode cache grows its RoPE tables
        past model.attention.max_seq_len (a prompt the model never trained at that length is still only as
        good as the model's long-context training)."""
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

    def evaluate(self, batches: int) -> tuple[float, Baselines]:
        """Bits per byte on `batches` validation batches, and the baselines of the same split."""
        data_cfg = self.config.data
        data_cfg.tokenizer_path = str(self.checkpoint / "tokenizer.json")
        data = build_data(data_cfg, self.config.train.seed, self.config.train.batch_size, self.device)
        return evaluate_bpb(self.model, data, self.device, batches), data.baselines


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest valid one under a run directory or its `checkpoints/`."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint or run directory (it is a file)")
    if CKPT_DIR_RE.match(path.name):
        return path
    # RUN/checkpoints itself (what a tab completion gives) means RUN, not RUN/checkpoints/checkpoints.
    run_dir = path.parent if checkpoint_root(path.parent) == path and not checkpoint_root(path).is_dir() else path
    found = latest_valid_checkpoint(run_dir)
    if found is None:
        raise CheckpointError(f"{path}: no valid checkpoint (looked in {checkpoint_root(run_dir)})")
    return found


def load_session(path: str | Path, cfg: Config) -> Session:
    """Rebuild the model from the checkpoint's own config; the device comes from ``cfg.train.device``."""
    ckpt = resolve_checkpoint(path)
    device = resolve_device(cfg.train.device)
    model_state, _, meta = load_checkpoint(ckpt, map_location=device)
    config = from_dict(meta["config"], source=f"{ckpt}/meta.json")
    config.train.device = cfg.train.device
    model = HybridLM(config.model).to(device)
    model.load_state_dict(model_state)
    model.eval()
    tokenizer = CodeTokenizer.from_file(ckpt / "tokenizer.json")
    return Session(model, tokenizer, config, ckpt, device)
