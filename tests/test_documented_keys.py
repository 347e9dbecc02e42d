"""What the README and the docs tell a user to type exists: every configuration key they name
(`--section.key` or `` `section.key` ``) is a field of the configuration, and every `megacpp <command>`
they show is a subcommand. A renamed key or command fails here, not in a user's terminal (the README
named `optim.qk_clip`, which never existed: the key is `model.attention.qk_clip`)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megacpp.cli import build_parser
from megacpp.config import Config

ROOT = Path(__file__).resolve().parents[1]
# Text under docs/ and the README that a user reads as instructions (the benchmarks archive is history).
DOCUMENTS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks_archive.md")]
# Dotted names the documents use that are not configuration keys: files and model attributes.
NOT_KEYS = {
    "model.safetensors",  # the checkpoint's weights file
    "train.bin",  # a shard file of the data cache
    "model.blocks", "model.forward",  # HybridLM's attribute and method (docs/compile.md)
}
_KEY = re.compile(r"(?:--|`)((?:model|optim|data|train|compile|dist)\.[a-z_]+(?:\.[a-z_]+)*)")
_INLINE_COMMAND = re.compile(r"`megacpp ([a-z][a-z-]*)")
_CODE_BLOCK = re.compile(r"^```[a-z]*\n(.*?)^```", re.M | re.S)
_BLOCK_COMMAND = re.compile(r"^\s*(?:torchrun [^\n]*?-m megacpp\.cli|megacpp) ([a-z][a-z-]*)", re.M)


def documented_commands(text: str) -> list[str]:
    """`megacpp <command>` in inline code, and at the start of a line in a fenced code block."""
    blocks = [_BLOCK_COMMAND.findall(block) for block in _CODE_BLOCK.findall(text)]
    return _INLINE_COMMAND.findall(text) + [cmd for found in blocks for cmd in found]


def config_keys(section: object, prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        keys |= config_keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else {prefix + f.name}
    return keys


def subcommands() -> set[str]:
    return {name for action in build_parser()._actions if isinstance(getattr(action, "choices", None), dict)
            for name in action.choices}


def test_every_documented_configuration_key_exists():
    known = config_keys(Config())
    unknown = sorted({(doc.name, key) for doc in DOCUMENTS for key in _KEY.findall(doc.read_text())
                      if key not in known and key not in NOT_KEYS})
    assert unknown == []


def test_every_documented_command_exists():
    known = subcommands()
    named = [(doc.name, cmd) for doc in DOCUMENTS for cmd in documented_commands(doc.read_text())]
    assert len(named) > 10, "the pattern finds the documents' commands"
    assert sorted({(doc, cmd) for doc, cmd in named if cmd not in known}) == []


def test_the_checks_find_a_key_and_a_command_that_do_not_exist():
    text = ("Set `optim.qk_clip weight`, then run `megacpp evaluate --checkpoint x`; megacpp trains.\n"
            "```bash\nmegacpp tune --preset small\n```\n")
    assert _KEY.findall(text) == ["optim.qk_clip"] and "optim.qk_clip" not in config_keys(Config())
    assert documented_commands(text) == ["evaluate", "tune"]
    assert not {"evaluate", "tune"} & subcommands()
