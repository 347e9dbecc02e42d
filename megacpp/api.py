"""megacpp as a library: a trained model from its checkpoint, to generate text, score text and read the
log-probabilities of its tokens, on CPU or GPU, with the same decode caches as `megacpp sample`.

    import megacpp

    model = megacpp.load("runs/tiny")                   # a run directory or one checkpoint; device "auto"
    model.generate("#include <vector>\\n", max_new_tokens=64, seed=1)
    model.score("int add(int a, int b) { return a + b; }")   # bits per byte of the text
    model.token_logprobs("int x = 0;")                 # [("int", -1.23), (" x", -2.05), ...]
    model.evaluate()                                     # the validation split, as `megacpp eval` measures it

The model, tokenizer and configuration are the checkpoint's own (its meta.json and tokenizer.json);
the weights are the safetensors file any other tool reads too.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from megacpp.config import Config
from megacpp.data.baselines import Baselines
from megacpp.infer.session import Session, load_session
from megacpp.runtime.device import autocast_context
from megacpp.runtime.evaluate import Evaluation


class Model:
    """A checkpoint's model with its tokenizer (see the module docstring)."""

    def __init__(self, session: Session) -> None:
        self._session = session

    @property
    def checkpoint(self) -> Path:
        return self._session.checkpoint

    @property
    def config(self) -> Config:
        return self._session.config

    @property
    def device(self) -> torch.device:
        return self._session.device

    @property
    def module(self) -> torch.nn.Module:
        """The `HybridLM` itself, in eval mode."""
        return self._session.model

    def generate(self, prompt: str, max_new_tokens: int = 160, temperature: float = 0.8, top_k: int = 40,
                 seed: int = 0) -> str:
        """``prompt`` and its continuation, up to ``max_new_tokens`` tokens or the end of a document;
        temperature 0 is greedy, top_k 0 samples from every token. The same text as `megacpp sample` with
        the same settings."""
        return "".join(self._session.stream(prompt, max_new_tokens, temperature, top_k, seed))

    def token_logprobs(self, text: str) -> list[tuple[str, float]]:
        """Each token of ``text`` with its natural-log probability given the tokens before it (the first
        given the start of a document), read in windows of the training's sequence length."""
        ids = self._session.prompt_ids(text)
        targets = torch.tensor(ids[1:], dtype=torch.long)
        logprobs = self._logprobs(ids)
        return [(self._session.tokenizer.decode([int(t)]), float(lp)) for t, lp in zip(targets, logprobs, strict=True)]

    def score(self, text: str) -> float:
        """Bits per byte of ``text`` as a document of its own: its tokens' negative log-probabilities
        in bits over its UTF-8 bytes (the figure `evaluate` reports over the validation split)."""
        n_bytes = len(text.encode("utf-8"))
        if n_bytes == 0:
            raise ValueError("score: the text is empty; expected at least one character")
        return -float(self._logprobs(self._session.prompt_ids(text)).double().sum()) / math.log(2) / n_bytes

    def evaluate(self, batches: int = 0) -> tuple[Evaluation, Baselines]:
        """The validation split's bits per byte (whole, or its first ``batches`` batches) and its baselines:
        what `megacpp eval` prints."""
        return self._session.evaluate(batches)

    @torch.no_grad()
    def _logprobs(self, ids: list[int]) -> torch.Tensor:
        """log p(ids[i] | ids[:i]) for i >= 1, in windows of seq_len + 1 tokens that overlap by one (as the
        training loader cuts a document: a window does not see the text before it)."""
        window = self.config.data.seq_len
        out = []
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor(ids[start:start + window + 1], dtype=torch.long, device=self.device)[None]
            with autocast_context(self.device):
                logits = self.module(chunk[:, :-1])
            picked = F.log_softmax(logits.float(), dim=-1).gather(-1, chunk[:, 1:, None])
            out.append(picked.view(-1).cpu())
        return torch.cat(out)


def load(path: str | Path, device: str = "auto") -> Model:
    """The model of a checkpoint, or of the newest valid checkpoint of a run directory, on ``device``
    ("auto": a GPU if there is one, else the CPU)."""
    cfg = Config()
    cfg.train.device = device
    return Model(load_session(path, cfg))
