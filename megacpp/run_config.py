"""The one way to build a run's config: preset < TOML file < command-line overrides, later layers
winning, each value's origin recorded (`Provenance`), then the gate (`megacpp.validate`) before any
data work; and a saved config (a checkpoint's meta.json) read back through the same gate. What passes
the gate is frozen (megacpp.section): the values it accepted are the values every layer reads.

It sits above `megacpp.config` (the dataclasses and parsing), `megacpp.presets` and `megacpp.validate`,
which all build on `megacpp.config`, so none of them needs a late import to break a cycle (presets.py
imports it late only so that the preset names, the CLI's choices, load without the sections).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megacpp.config import (
    Config,
    ConfigError,
    Provenance,
    TomlFile,
    apply_overrides,
    cli_where,
    merge_dict,
    read_toml,
)
from megacpp.model.config import without_retired
from megacpp.presets import PRESETS, preset
from megacpp.section import freeze, is_frozen
from megacpp.validate import validate_config

DEFAULT_PRESET = "tiny"
# A model key a user never sets: training takes it from the tokenizer (megacpp.train.plan.trained_config).
DERIVED_VOCAB = "model.vocab_size"


def resolve_preset(cli_preset: str | None, file: TomlFile | None) -> str | None:
    """The preset a run starts from; None means the built-in defaults.

    --preset and the file's `preset = ...` must agree when both are given: silently preferring one
    would train a model the user did not ask for. With neither, a file starts from the built-in
    defaults (it is a whole configuration of its own) and no file means DEFAULT_PRESET.
    """
    file_preset = file.preset if file is not None else None
    if cli_preset and file_preset and cli_preset != file_preset:
        raise ConfigError(
            f"command line --preset {cli_preset} conflicts with preset = {file_preset!r} at "
            f"{file.where('preset')}: drop one, or name the same preset in both"
        )
    if file_preset and file_preset not in PRESETS:  # named with its line; --preset is checked by argparse
        raise ConfigError(f"{file.where('preset')}: unknown preset {file_preset!r}; available presets: "
                          f"{', '.join(PRESETS)}")
    if cli_preset or file_preset:
        return cli_preset or file_preset
    return None if file is not None else DEFAULT_PRESET


def _starting_point(preset_name: str | None) -> tuple[Config, Provenance]:
    if preset_name is None:
        return Config(), Provenance("built-in default")
    return preset(preset_name), Provenance(f"preset {preset_name!r}")


def load_config(
    preset_name: str | None = None,
    path: str | Path | None = None,
    overrides: Sequence[tuple[str, str]] = (),
) -> tuple[Config, Provenance]:
    """Merge preset < TOML file < command-line overrides, later layers winning, and record where each
    value came from; then the gate (`megacpp.validate`) checks the result, before any data work."""
    file = read_toml(path) if path is not None else None
    cfg, sources = _starting_point(resolve_preset(preset_name, file))
    if file is not None:
        merge_dict(cfg, file.data, file.where, sources)
    cfg = apply_overrides(cfg, overrides)
    for dotted, _ in overrides:
        sources.record(dotted, cli_where(dotted))
    if sources.is_set(DERIVED_VOCAB):
        raise ConfigError(f"{sources.source(DERIVED_VOCAB)}: {DERIVED_VOCAB} is the tokenizer's vocabulary and is set "
                          "from it when training: set data.vocab_size (the vocabulary a tokenizer is trained to) or "
                          "data.tokenizer_path instead, and drop model.vocab_size")
    return gate(cfg, sources), sources


def from_dict(data: dict[str, Any], source: str = "checkpoint") -> Config:
    """A config saved by `to_dict` (e.g. a checkpoint's meta.json); ``source`` names it in errors. Model
    settings the code no longer has (`RETIRED_MODEL_SETTINGS`) are dropped, not refused."""
    cfg = Config()
    sources = Provenance(source)
    if isinstance(data.get("model"), dict):
        data = {**data, "model": without_retired(data["model"])}
    merge_dict(cfg, data, lambda _key: source, sources)
    return gate(cfg, sources)


def gate(cfg: Config, sources: Provenance | None = None) -> Config:
    """The gate, once: a frozen copy of ``cfg`` if it passes (a frozen config has passed already and is
    returned as it is). ``sources`` names where each value came from in the errors."""
    if is_frozen(cfg):
        return cfg
    validate_config(cfg, sources)
    return freeze(cfg)
