"""The rules a resume must meet: which settings may change between a checkpoint's run and the run that
continues it, and which would make it another run (another model, token stream or tokenizer).

`check_resume_settings` needs only the configuration, so it runs before the data work; `check_compatible`
compares the tokenizer and the model once they exist. The checkpoint format itself is
megacpp.runtime.checkpoint's.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from megacpp.model.config import ModelConfig, without_retired
from megacpp.optim.config import OptimConfig
from megacpp.runtime.checkpoint import CheckpointError, saved_step_rows


def check_resume_settings(meta: dict[str, Any], config: dict[str, Any], world_size: int, where: Path
                          ) -> list[tuple[str, Any, Any]]:
    """Refuse, from the configuration alone, a resume that cannot continue the run of checkpoint `where`
    (`meta` is its metadata, `config` this run's whole configuration as a dict), naming the setting and
    why: another model (but for its vocabulary size, which the tokenizer sets, and the settings in
    `RESUMABLE_MODEL_SETTINGS`), sequence length, tokenizer vocabulary, global batch or loader seed. Needs
    no data, so it runs before the data work; the tokenizer itself is compared afterwards
    (`check_compatible`). Optimizer settings (learning rates, optim.lr_scale_by_kind, the schedule) may
    change: the saved moments are keyed by parameter name, not by param group, and a new lr changes no
    shape. Returns the resumable model settings that change, (key, checkpoint's, now), for the log."""
    saved = meta.get("config", {})
    refused, changed = model_changes(saved.get("model", {}), config["model"])
    refused = [d for d in refused if d[0] != "vocab_size"]
    if refused:
        _refuse_model(where, refused)
    data, saved_data = config["data"], saved.get("data", {})
    saved_len = saved_data.get("seq_len")
    if saved_len is not None and saved_len != data["seq_len"]:
        _refuse_seq_len(where, saved_len, data["seq_len"])
    saved_vocab = saved_data.get("vocab_size")
    trained = saved_data.get("tokenizer_path") is None and data["tokenizer_path"] is None
    if trained and saved_vocab is not None and saved_vocab != data["vocab_size"]:
        raise CheckpointError(
            f"{where}: data.vocab_size: checkpoint {saved_vocab} vs now {data['vocab_size']}: the tokenizer would "
            "be trained to another vocabulary, which the weights' embeddings and the saved token stream do not "
            f"match; resume with --data.vocab_size {saved_vocab}")
    train, saved_train = config["train"], saved.get("train", {})
    rows, saved_rows = rows_per_step(meta, config, world_size)
    if saved_rows != rows and not config["dist"]["allow_global_batch_change"]:
        raise CheckpointError(
            f"{where}: written with {saved_rows} rows per optimizer step ({meta.get('world_size')} rank(s) x "
            f"train.batch_size x train.grad_accum), this run has {rows} ({world_size} x {train['batch_size']} x "
            f"{train['grad_accum']}): it would read another token stream. Keep ranks x batch_size x grad_accum "
            "equal, or set dist.allow_global_batch_change = true")
    if "seed" in saved_train and "shuffle_seed" in saved_data:
        saved_seeds, seeds = (saved_train["seed"], saved_data["shuffle_seed"]), (train["seed"], data["shuffle_seed"])
        if sum(saved_seeds) != sum(seeds):
            raise CheckpointError(
                f"{where}: train.seed + data.shuffle_seed: checkpoint {saved_seeds[0]} + {saved_seeds[1]} vs now "
                f"{seeds[0]} + {seeds[1]}: the loader deals the rows in an order drawn from their sum, so the "
                f"resumed run would read another token stream; resume with --train.seed {saved_seeds[0]} "
                f"--data.shuffle_seed {saved_seeds[1]}")
    return changed


def rows_per_step(meta: dict[str, Any], config: dict[str, Any], world_size: int) -> tuple[int, int]:
    """(this run's, the checkpoint's) rows per optimizer step: ranks x batch_size x grad_accum. The loader
    deals rows in one order for any global batch (megacpp.data.loader), so runs with equal rows per step
    read the same rows in every step (e.g. 2 GPUs x 16 and 1 GPU x 16 x 2 accumulated); only the rows an
    epoch's end drops differ, fewer than one global batch."""
    train = config["train"]
    rows = world_size * train["batch_size"] * train["grad_accum"]
    return rows, saved_step_rows(meta, world_size * train["batch_size"])


def check_compatible(meta: dict[str, Any], model_config: dict[str, Any], tokenizer_hash: str, where: Path,
                     seq_len: int | None = None) -> None:
    """Refuse to resume into a different model, tokenizer or sequence length, naming what differs.
    (The global batch is checked by `check_resume_settings`, given the rank count.)"""
    refused, _ = model_changes(meta.get("config", {}).get("model", {}), model_config)
    if refused:
        _refuse_model(where, refused)
    saved_len = meta.get("config", {}).get("data", {}).get("seq_len")
    if seq_len is not None and saved_len is not None and saved_len != seq_len:
        _refuse_seq_len(where, saved_len, seq_len)
    if meta.get("tokenizer_hash") != tokenizer_hash:
        raise CheckpointError(
            f"{where}: trained with tokenizer {str(meta.get('tokenizer_hash'))[:12]}, "
            f"this run uses {tokenizer_hash[:12]}"
        )


# Optimizer settings that choose how moments are stored. A resume may change them: the checkpoint's moments
# load into this run's buffers, which converts them (bf16 -> fp32 exactly, fp32 -> bf16 rounded once).
STATE_DTYPE_SETTINGS = ("momentum_dtype", "adamw_momentum_dtype")


def state_dtype_changes(meta: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """One line per moment storage dtype that differs between checkpoint and this run, saying what the load
    does to the saved moments. A setting the checkpoint does not record is taken at its default, the
    dtype it was written with before the setting existed."""
    saved, now = meta.get("config", {}).get("optim", {}), config["optim"]
    lines = []
    for key in STATE_DTYPE_SETTINGS:
        before = saved.get(key, getattr(OptimConfig, key))
        if before != now[key]:
            effect = "widened exactly" if now[key] == "float32" else "rounded once"
            lines.append(f"resuming with optim.{key} = {now[key]!r} (the checkpoint stored {before!r}): its moments "
                         f"are {effect} as they load")
    return lines


# Model settings that change how the model is computed, or how its weights are kept in bounds after a
# step, not what the weights are: a resume may change them (the trainer logs each change). `small` changed
# three of them between releases (scan_matmuls, w_spectral_cap, loss_kernel); had they been refused, its
# earlier runs would be unresumable.
RESUMABLE_MODEL_SETTINGS = frozenset({
    "attention.backend", "loss_kernel", "mamba.scan_kernel", "mamba.scan_matmuls", "moe.dispatch",
    "rnn.w_spectral_cap",
})


def model_changes(saved: dict[str, Any], now: dict[str, Any]
                  ) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """The differences (key, checkpoint's, now) between a checkpoint's model config and this run's, split
    into those a resume must refuse and those in `RESUMABLE_MODEL_SETTINGS`. A setting either side does not
    record is taken at its default: a checkpoint written before a setting existed trained with the
    behaviour that setting's default keeps; one the code no longer has (`RETIRED_MODEL_SETTINGS`) is dropped."""
    defaults = dataclasses.asdict(ModelConfig())
    diffs = _dict_diff(_with_defaults(without_retired(saved), defaults), _with_defaults(now, defaults))
    refused = [d for d in diffs if d[0] not in RESUMABLE_MODEL_SETTINGS]
    return refused, [d for d in diffs if d[0] in RESUMABLE_MODEL_SETTINGS]


def _with_defaults(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    for key, value in values.items():
        both_dicts = isinstance(value, dict) and isinstance(defaults.get(key), dict)
        out[key] = _with_defaults(value, defaults[key]) if both_dicts else value
    return out


def _refuse_model(where: Path, diffs: list[tuple[str, Any, Any]]) -> None:
    shown = "; ".join(f"model.{k}: checkpoint {a!r} vs now {b!r}" for k, a, b in diffs[:5])
    raise CheckpointError(f"{where}: incompatible model config ({shown}): the weights have another shape "
                          "or meaning; resume with the checkpoint's settings or train into another out_dir")


def _refuse_seq_len(where: Path, saved: int, now: int) -> None:
    raise CheckpointError(f"{where}: data.seq_len: checkpoint {saved} vs now {now}: the loader's saved position "
                          "counts rows of the old length, so the resumed run would read another token stream; "
                          f"resume with --data.seq_len {saved}")


def _dict_diff(a: dict, b: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out.extend(_dict_diff(va, vb, f"{prefix}{key}."))
        elif va != vb:
            out.append((f"{prefix}{key}", va, vb))
    return out
