"""The one version-gate table: every torch-version-dependent branch in megacpp reads it.

Versions are compared as parsed release tuples, never as strings ("2.9" > "2.12" as strings).
Ordering follows PEP 440 for the subset torch uses: ``2.12.0.dev20260304`` < ``2.12.0a0`` <
``2.12.0rc1`` < ``2.12.0`` < ``2.12.0.post1``; a local suffix (``+cu130``, ``+cpu``) does not order.
A nightly of X is therefore *older* than X and takes the fallback path of a gate whose minimum is X:
a nightly may predate the feature, and the fallback is the safe side.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import total_ordering

import torch

_VERSION_RE = re.compile(
    r"^\s*v?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[.-]?(?P<pre>a|b|rc|alpha|beta|c)[.-]?(?P<pre_n>\d*))?"
    r"(?:[.-]?post[.-]?(?P<post>\d*))?"
    r"(?:[.-]?dev[.-]?(?P<dev>\d*))?"
    r"(?:\+(?P<local>[0-9A-Za-z.]+))?\s*$"
)
_PRE_ALIASES = {"alpha": "a", "beta": "b", "c": "rc"}
_PRE_RANK = {"a": 0, "b": 1, "rc": 2}


@total_ordering
@dataclass(frozen=True)
class Version:
    """A parsed version; compares by release, then pre/dev/post stage; ``local`` never orders."""

    release: tuple[int, ...]
    pre: tuple[str, int] | None = None
    post: int | None = None
    dev: int | None = None
    local: str | None = None

    def _key(self) -> tuple:
        release = self.release
        while len(release) > 1 and release[-1] == 0:  # 2.12 == 2.12.0
            release = release[:-1]
        if self.pre is None and self.post is None and self.dev is not None:
            stage = (-1, 0)  # X.devN sorts before every pre-release of X
        elif self.pre is None:
            stage = (3, 0)  # a final release sorts after its pre-releases
        else:
            stage = (_PRE_RANK[self.pre[0]], self.pre[1])
        post = -1 if self.post is None else self.post
        dev = float("inf") if self.dev is None else self.dev  # X.postN.devM < X.postN
        return (release, stage, post, dev)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            other = parse_version(other)
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() == other._key()

    def __lt__(self, other: object) -> bool:
        if isinstance(other, str):
            other = parse_version(other)
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        text = ".".join(str(p) for p in self.release)
        if self.pre is not None:
            text += f"{self.pre[0]}{self.pre[1]}"
        if self.post is not None:
            text += f".post{self.post}"
        if self.dev is not None:
            text += f".dev{self.dev}"
        if self.local is not None:
            text += f"+{self.local}"
        return text


def parse_version(text: str) -> Version:
    """Parse ``2.13.0``, ``2.12.0.dev20260304+cu130``, ``2.11.0rc2``, ``2.9`` into a `Version`."""
    match = _VERSION_RE.match(str(text))
    if match is None:
        raise ValueError(f"not a version string: {text!r}")
    pre = None
    if match["pre"]:
        pre = (_PRE_ALIASES.get(match["pre"], match["pre"]), int(match["pre_n"] or 0))
    return Version(
        release=tuple(int(p) for p in match["release"].split(".")),
        pre=pre,
        post=None if match["post"] is None else int(match["post"] or 0),
        dev=None if match["dev"] is None else int(match["dev"] or 0),
        local=match["local"],
    )


@dataclass(frozen=True)
class Gate:
    """A feature and the first torch release that has it."""

    min_version: str
    what: str


# feature -> first torch that has it. megacpp needs torch >= 2.11, so today every gate passes on
# supported versions; the table still decides the branch so that a change of name or a removal is
# one edit here, and so that tests can drive the fallback side by passing a version.
GATES: dict[str, Gate] = {
    "recompile_limit_names": Gate(
        "2.7",
        "dynamo config `recompile_limit` / `accumulated_recompile_limit` (older torch: "
        "`cache_size_limit` / `accumulated_cache_size_limit`, which stay as aliases)",
    ),
    "cache_artifacts": Gate(
        "2.7",
        "Mega-Cache: torch.compiler.save_cache_artifacts / load_cache_artifacts",
    ),
    "flex_attention": Gate(
        "2.5",
        "torch.nn.attention.flex_attention (document masks as block masks; SDPA with a dense mask otherwise)",
    ),
    "pg_timeout": Gate(
        "2.4",
        "torch.distributed.distributed_c10d._set_pg_timeout: tighten a process group's timeout once "
        "compilation is over (private, the only way; without it the long init timeout stays)",
    ),
    "grouped_mm": Gate(
        "2.11",
        "torch.nn.functional.grouped_mm (MoE's dropless grouped dispatch; without it token choice keeps the "
        "padded dispatch). Used on 2.11 (H200) and 2.13 (CPU); earlier releases were not checked",
    ),
    "custom_op": Gate(
        "2.4",
        "torch.library.custom_op + register_fake + register_autograd: an opaque kernel stays one "
        "node inside the graph; without it the kernel is wrapped in torch.compiler.disable (a break)",
    ),
}


def torch_version() -> Version:
    """The running torch's version (the only place megacpp reads ``torch.__version__``)."""
    return parse_version(torch.__version__)


def supports(feature: str, version: str | Version | None = None) -> bool:
    """Whether `version` (default: the running torch) has `feature` from `GATES`."""
    if feature not in GATES:
        raise KeyError(f"unknown version gate {feature!r}; known: {sorted(GATES)}")
    if version is None:
        current = torch_version()
    elif isinstance(version, Version):
        current = version
    else:
        current = parse_version(version)
    return current >= parse_version(GATES[feature].min_version)
