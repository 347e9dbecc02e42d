"""Fine-tuning: a new run that starts from a checkpoint's weights (``train.init_from``) on other data.

The run takes from the checkpoint its model (the configuration's model section, so the weights fit) and
its tokenizer (its `tokenizer.json`, so the token ids mean what the weights learned), and nothing else:
the optimizer state and the learning-rate schedule start afresh, the loader reads the new corpus from
its start, and the run directory is a new one. A ``--resume`` of the fine-tuning run later continues
from that run's own checkpoints, as any run does.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from megacpp.config import Config, to_dict
from megacpp.run_config import from_dict, gate
from megacpp.runtime.checkpoint import CheckpointError, resolve_checkpoint, verify_checkpoint
from megacpp.train.resume_rules import model_changes


def fine_tuning_config(cfg: Config, log: Callable[[str], None]) -> tuple[Config, Path]:
    """(the configuration to train with, the checkpoint) for ``cfg.train.init_from``: ``cfg`` with the
    checkpoint's model section and tokenizer."""
    path = resolve_checkpoint(cfg.train.init_from)
    meta = verify_checkpoint(path)
    source = from_dict(meta["config"], source=f"{path}/meta.json")
    tokenizer = path / "tokenizer.json"
    data = dataclasses.replace(cfg.data, tokenizer_path=str(tokenizer), vocab_size=source.data.vocab_size)
    log(f"fine-tuning from {path} (step {meta.get('step')}): its weights, its model settings and its tokenizer "
        f"{str(meta.get('tokenizer_hash'))[:12]} ({tokenizer}); a fresh optimizer and schedule on this run's data")
    refused, resumable = model_changes(to_dict(source.model), to_dict(cfg.model))
    replaced = [d for d in refused + resumable if d[0] != "vocab_size"]
    if replaced:
        log("fine-tuning: the checkpoint's model settings replace this run's: " + ", ".join(
            f"model.{key} {now!r} -> {saved!r}" for key, saved, now in replaced[:8]))
    return gate(dataclasses.replace(cfg, model=source.model, data=data)), path


def load_initial_weights(model: nn.Module, path: Path) -> None:
    """The checkpoint's weights into ``model`` (built from the same model settings), every tensor."""
    try:
        weights = load_file(path / "model.safetensors", device=str(next(model.parameters()).device))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable weights ({exc})") from exc
    model.load_state_dict(weights)
