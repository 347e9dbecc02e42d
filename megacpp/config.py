"""Run configuration: nested dataclasses, TOML files, ``--section.key value`` overrides, provenance.

The layers are merged and checked by `megacpp.run_config` (preset < TOML file < command line, then the
gate); this module holds what both the presets and the gate build on. Every error names the offending
key and where it came from (file and line, the command line, the preset or a checkpoint's meta.json).

`Config` composes the section dataclasses, each defined beside the code that reads it (model/, optim/,
data/, train/, compile/, distributed/) on the vocabulary of `megacpp.rules`: importing those `config`
modules from packages above this one is the one exception to the rule that imports run down
(tests/test_layering.py).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from megacpp.compile.config import CompileConfig
from megacpp.data.config import DataConfig
from megacpp.distributed.config import DistConfig
from megacpp.errors import ConfigError
from megacpp.model.config import RETIRED_MODEL_SETTINGS, ModelConfig
from megacpp.optim.config import OptimConfig
from megacpp.rules import Provenance, coerce, field_types
from megacpp.section import Section
from megacpp.train.config import TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


@dataclass
class Config(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    dist: DistConfig = field(default_factory=DistConfig)


def _unknown_key(key: str, known: list[str], where: str) -> ConfigError:
    if key.removeprefix("model.") in RETIRED_MODEL_SETTINGS:  # a close match would name another setting
        return ConfigError(f"{where}: {key!r} was removed from megacpp (it changed no weight; a checkpoint that "
                           "records it still loads): delete it")
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigError(f"{where}: unknown config key {key!r}{hint}")


def merge_dict(
    obj: Any, data: dict[str, Any], where: Callable[[str], str], sources: Provenance, prefix: str = ""
) -> None:
    """Recursively assign ``data`` onto the dataclass ``obj`` with type checks, recording each key's source."""
    hints = field_types(type(obj))
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            raise _unknown_key(dotted, list(hints), where(dotted))
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where(dotted)}: {dotted!r} is a section, got {value!r}")
            merge_dict(current, value, where, sources, f"{dotted}.")
        else:
            setattr(obj, key, coerce(value, hints[key], f"{where(dotted)}: {dotted!r}"))
            sources.record(dotted, where(dotted))


# ---------------------------------------------------------------- TOML files


def _key_line(text: str, dotted: str) -> int | None:
    """Best-effort line number of ``dotted`` in a TOML text (tomllib keeps no positions)."""
    *sections, key = dotted.split(".")
    section = ".".join(sections)
    current = ""
    pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for lineno, line in enumerate(text.splitlines(), 1):
        header = re.match(r"^\s*\[([^\]]+)\]", line)
        if header:
            current = header.group(1).strip()
        elif current == section and pattern.match(line):
            return lineno
    return None


class TomlFile(NamedTuple):
    data: dict[str, Any]  # the file's table, without its `preset` key
    preset: str | None  # its `preset = "..."`, if any
    where: Callable[[str], str]  # dotted key -> "file:line" (or the file alone when not found)


def read_toml(path: str | Path) -> TomlFile:
    """Parse a TOML config file; errors name the file (and line, where tomllib gives one)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} {'is not a file' if path.exists() else 'does not exist'}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (bad byte at offset {exc.start}); TOML files are UTF-8") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc

    def where(dotted: str) -> str:
        line = _key_line(text, dotted)
        return f"{path}:{line}" if line else str(path)

    preset_name = data.pop("preset", None)
    if preset_name is not None and not isinstance(preset_name, str):
        raise ConfigError(f"{where('preset')}: 'preset' expects a preset name, got {preset_name!r}")
    return TomlFile(data, preset_name, where)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# What an unset (None) key means, for `megacpp config`: TOML has no null, so these are comments.
UNSET_MEANS = {
    "data.corpus": "the C++ headers inside the installed torch (torch/include)",
    "data.tokenizer_path": "a tokenizer trained on the corpus (cached)",
    "data.cache_dir": "$MEGACPP_CACHE_DIR/data, else ~/.cache/megacpp/data",
    "data.baseline_context_bytes": "the whole training split",
    "train.init_from": "no fine-tuning: the run starts from fresh weights",
    "optim.muon_rms_lr": "optim.adamw_lr",
    "optim.embed_lr": "optim.adamw_lr",
    "optim.head_lr": "optim.adamw_lr",
    "optim.expert_ns_steps": "optim.ns_steps",
    "optim.warmup_steps": "optim.warmup_frac of train.steps",
    "optim.decay_steps": "optim.decay_frac of train.steps",
}
# Keys a run derives instead of reading: written as comments, so a file read back never sets them.
DERIVED = {"model.vocab_size": "the tokenizer's vocabulary (data.vocab_size) when training"}


def dump_toml(cfg: Any) -> str:
    """Serialise a config as TOML. A None value (TOML has no null) and a derived key are written as a
    comment saying what they mean."""
    lines: list[str] = []

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    def emit(obj: dict[str, Any], section: str) -> None:
        scalars = {k: v for k, v in obj.items() if not isinstance(v, dict)}
        if section and scalars:
            lines.append(f"\n[{section}]")
        for k, v in scalars.items():
            dotted = f"{section}.{k}" if section else k
            if dotted in DERIVED:
                lines.append(f"# {k}: {DERIVED[dotted]}")
            elif v is None:
                lines.append(f"# {k}: unset, {UNSET_MEANS[dotted]}")
            else:
                lines.append(f"{k} = {fmt(v)}")
        for k, v in obj.items():
            if isinstance(v, dict):
                emit(v, f"{section}.{k}" if section else k)

    emit(to_dict(cfg), "")
    return "\n".join(lines).lstrip() + "\n"


# ---------------------------------------------------------------- command-line overrides


def _parse_cli_value(raw: str, tp: Any, where: str) -> Any:
    """Parse a command-line string for a field of type ``tp`` (TOML syntax for lists)."""
    origin = typing.get_origin(tp)
    options = typing.get_args(tp) if origin in (typing.Union, types.UnionType) else (tp,)
    if raw.lower() in ("none", "null") and type(None) in options:
        return None
    concrete = [o for o in options if o is not type(None)]
    target = concrete[0] if len(concrete) == 1 else tp
    if target is bool:
        lowered = raw.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {raw!r}")
    if target is str:
        return raw
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        # Not TOML: a list field takes bare comma-separated items. One that also has word choices
        # (data.corpus: paths or "system") takes them only when each looks like a path, so that a
        # misspelt choice is an error, not a directory that does not exist.
        listed = next((o for o in concrete if typing.get_origin(o) in (list, tuple)), None)
        choices = [c for o in concrete if typing.get_origin(o) is typing.Literal for c in typing.get_args(o)]
        items = [v.strip() for v in raw.split(",") if v.strip()]
        if listed is not None and raw not in choices:
            if choices and not all(_looks_like_path(v) for v in items):
                raise ConfigError(f"{where}: expected one of {', '.join(map(repr, choices))} or paths (a path "
                                  f"contains '/': ./{raw}; several: a,b or [\"a\", \"b\"]), got {raw!r}") from None
            item_tp = (typing.get_args(listed) or (str,))[0]
            value = [_parse_cli_value(v, item_tp, where) for v in items]
        else:
            value = raw
    return coerce(value, tp, where)


def _looks_like_path(text: str) -> bool:
    return "/" in text or os.sep in text or text in (".", "..") or text.startswith("~")


def cli_where(dotted: str) -> str:
    return f"command line --{dotted}"


def apply_overrides(cfg: Config, overrides: Sequence[tuple[str, str]]) -> Config:
    """A copy of ``cfg`` with ``[("model.depth", "8"), ...]`` applied; unknown keys and wrong types
    raise ConfigError. One merge step only: `load_config` runs the gate on the finished result."""
    cfg = copy.deepcopy(cfg)
    for dotted, raw in overrides:
        where = cli_where(dotted)
        *path, key = dotted.split(".")
        obj: Any = cfg
        for i, part in enumerate(path):
            hints = field_types(type(obj))
            if part not in hints or not dataclasses.is_dataclass(getattr(obj, part)):
                raise _unknown_key(".".join(path[: i + 1]), list(hints), where)
            obj = getattr(obj, part)
        hints = field_types(type(obj))
        if key not in hints or dataclasses.is_dataclass(getattr(obj, key)):
            raise _unknown_key(dotted, [k for k in hints if not dataclasses.is_dataclass(getattr(obj, k))], where)
        setattr(obj, key, _parse_cli_value(raw, hints[key], where))
    return cfg
