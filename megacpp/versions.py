"""Installed versions: the one version-gate table, which every torch-version-dependent branch in
megacpp reads, and the version of any installed package (`package_version`).

The model, the compile policy, the distributed layer and `megacpp doctor` all read these facts, so they
sit at the bottom of the package and import nothing of it.

Versions are parsed by `packaging.version` (PEP 440) and compared as versions, never as strings
("2.9" > "2.12" as strings): ``2.12.0.dev20260304`` < ``2.12.0a0`` < ``2.12.0rc1`` < ``2.12.0`` <
``2.12.0.post1``. A local label (``+cu130``, ``+cpu``) is kept for display but never decides a
comparison here (`public_version` drops it). A nightly of X is therefore *older* than X and takes the
fallback path of a gate whose minimum is X: a nightly may predate the feature, and the fallback is
the safe side.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from packaging.version import Version


def parse_version(text: str) -> Version:
    """Parse ``2.13.0``, ``2.12.0.dev20260304+cu130``, ``2.11.0rc2``, ``2.9``; ValueError if not PEP 440."""
    return Version(str(text))  # packaging's InvalidVersion is a ValueError


def public_version(version: Version) -> Version:
    """`version` without its local label: ``2.11.0+cu130`` -> ``2.11.0``, the part that orders builds."""
    return Version(version.public)


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
    "all_gather_single": Gate(
        "2.13",
        "torch.distributed.all_gather_single, which 2.13 asks for instead of all_gather_into_tensor (same "
        "signature; the older name warns there). Seen in 2.13; 2.11 lacks it",
    ),
}


def torch_version() -> Version:
    """The running torch's version (the only place megacpp reads ``torch.__version__``)."""
    # Imported here: the configuration gate reads the gate table (MoE's grouped dispatch) and must not
    # load torch (~1.5 s) before `megacpp config` answers, unless a rule asks for the running version.
    import torch

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
    return public_version(current) >= parse_version(GATES[feature].min_version)


def package_version(module: str) -> str:
    """An installed package's ``__version__`` ("installed" when it has none), or "not installed"."""
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except ImportError:
        return "not installed"
