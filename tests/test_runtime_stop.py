"""The `stop` hooks of evaluation and generation (how Ctrl-C cuts training's final evaluation and sample
short): asked before every batch or token, they end the work there and change nothing else."""
from __future__ import annotations

import itertools

import torch

from megacpp.model.hybrid import HybridLM
from megacpp.runtime.data import build_data
from megacpp.runtime.evaluate import evaluate_bpb
from megacpp.runtime.generate import generate_tokens
from tests.helpers import tiny_train_config


def _quiet(_line: str) -> None:
    pass


def _model(cfg) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(cfg.model).eval()


def test_tier1_generation_stops_before_the_token_whose_ask_says_stop(tmp_path, small_corpus) -> None:
    cfg = tiny_train_config(tmp_path, small_corpus)
    cfg.model.vocab_size = 300
    model = _model(cfg)
    prompt = [1, 5, 7]
    full = list(generate_tokens(model, prompt, 6, temperature=0.8, top_k=40, seed=3))
    asks = itertools.count(1)
    cut = list(generate_tokens(model, prompt, 6, temperature=0.8, top_k=40, seed=3, stop=lambda: next(asks) == 4))
    assert len(full) == 6 and cut == full[:3]
    assert next(asks) == 5, "asked once per token, before it"


def test_tier1_evaluation_stopped_returns_none_and_unstopped_equals_no_hook(tmp_path, small_corpus) -> None:
    cfg = tiny_train_config(tmp_path, small_corpus)
    data = build_data(cfg.data, cfg.train.seed, cfg.train.batch_size, "cpu", _quiet, progress=False)
    cfg.model.vocab_size = data.tokenizer.vocab_size
    model = _model(cfg).train()
    reference = evaluate_bpb(model, data, data.device, 2)
    asks = itertools.count(1)
    assert evaluate_bpb(model, data, data.device, 2, stop=lambda: next(asks) == 2) is None
    assert next(asks) == 3, "stopped at the second batch's ask"
    assert model.training, "the model's mode is restored"
    assert evaluate_bpb(model, data, data.device, 2, stop=lambda: False) == reference
