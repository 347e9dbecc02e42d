"""The installed stack as megacpp sees it: an ABI audit of compiled extensions, and a frozen record.

Audit. A compiled extension built against another torch fails deep inside a kernel or at import with
an undefined symbol, long after launch. For Triton (megacpp's own kernels) and every installed package
with compiled code that depends on torch (flash-attn, mamba_ssm, ...), `audit` compares the torch and
CUDA versions the package says it was built for (its version label, e.g. ``2.3.2+cu12torch2.4``, and
its ``Requires-Dist: torch`` pin) with the running ones, and imports it in a subprocess: a package whose
label matches but whose binary fails with an undefined symbol is named as mislabelled.

Freeze. `freeze` records the exact environment (Python, platform, torch, CUDA, cuDNN, NCCL, Triton, GPUs
and driver, every installed distribution, megacpp's commit) as JSON; `compare` lists every difference
against a record, e.g. between the hosts of a run ("freeze one image and compare").
"""
from __future__ import annotations

import importlib.metadata as metadata
import json
import platform
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megacpp.errors import ConfigError, MegacppError, UsageError
from megacpp.fs import atomic_write_text
from megacpp.versions import parse_version, public_version, torch_version

# Compiled packages megacpp may load through their Python APIs even when they do not declare torch.
KNOWN_EXTENSIONS = ("flash_attn", "flash-attn", "mamba_ssm", "mamba-ssm", "causal_conv1d", "causal-conv1d",
                    "xformers", "apex", "transformer_engine", "transformer-engine", "deepspeed")
_COMPILED_SUFFIXES = (".so", ".pyd")
_LABEL_TORCH = re.compile(r"torch[_-]?(\d+)\.?(\d+)")
_LABEL_CUDA = re.compile(r"cu(\d{2,3})")
_PIN_TORCH = re.compile(r"^torch\s*(?:==|~=|>=)\s*(\d+)\.(\d+)")


@dataclass
class Verdict:
    package: str
    version: str
    built_for: str  # what the package says it was built for
    verdict: str  # "ok", or what is wrong
    ok: bool

    def line(self) -> str:
        mark = "ok " if self.ok else "BAD"
        return f"{mark} {self.package} {self.version}: {self.built_for}; {self.verdict}"


def _name(dist: metadata.Distribution) -> str:
    return dist.metadata["Name"] or "?"


def _compiled(dist: metadata.Distribution) -> bool:
    return any(str(f).endswith(_COMPILED_SUFFIXES) for f in dist.files or [])


def _torch_pins(dist: metadata.Distribution) -> list[str]:
    """Unconditional torch requirements (extras such as ``torch ; extra == 'torch'`` do not count)."""
    return [r for r in dist.requires or [] if re.match(r"^torch\b", r) and "extra ==" not in r]


def _top_level(dist: metadata.Distribution) -> str | None:
    text = dist.read_text("top_level.txt")
    if text and text.split():
        return text.split()[0]
    modules = {str(f).split("/")[0].removesuffix(".py") for f in dist.files or []
               if str(f).endswith((".py", *_COMPILED_SUFFIXES)) and ".dist-info" not in str(f)}
    return sorted(modules)[0] if modules else None


def extension_packages(paths: Iterable[str] | None = None) -> list[metadata.Distribution]:
    """Installed distributions with compiled code that depend on torch or are known torch extensions."""
    found = {}
    for dist in metadata.distributions(**({"path": list(paths)} if paths is not None else {})):
        name = _name(dist)
        if name == "torch" or not _compiled(dist):
            continue
        if _torch_pins(dist) or name.lower() in KNOWN_EXTENSIONS or "torch" in dist.version:
            found.setdefault(name.lower(), dist)
    return list(found.values())


def _label(dist: metadata.Distribution) -> tuple[tuple[int, int] | None, int | None]:
    """(torch major.minor, CUDA major) the package says it was built for, where it says so."""
    local = dist.version.partition("+")[2]
    torch_mm = None
    if match := _LABEL_TORCH.search(local):
        torch_mm = (int(match[1]), int(match[2]))
    else:
        for pin in _torch_pins(dist):
            if (match := _PIN_TORCH.match(pin)) and "==" in pin:
                torch_mm = (int(match[1]), int(match[2]))
    cuda = int(match[1][:2]) if (match := _LABEL_CUDA.search(local)) else None
    return torch_mm, cuda


def import_check(module: str, paths: Iterable[str] = (), timeout: float = 60.0) -> str | None:
    """None if `module` imports in a fresh interpreter (after torch, as megacpp imports it), else the
    failure's last line. A subprocess: a bad binary may crash the interpreter."""
    code = "import sys; sys.path[:0] = sys.argv[2:]; import torch, importlib; importlib.import_module(sys.argv[1])"
    try:
        proc = subprocess.run([sys.executable, "-c", code, module, *paths], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"import of {module} did not finish in {timeout:.0f} s"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


def _check_extension(dist: metadata.Distribution, running: tuple[int, int], cuda: int | None,
                     paths: Iterable[str]) -> Verdict:
    name, torch_mm, label_cuda = _name(dist), *_label(dist)
    built = ", ".join(filter(None, [f"torch {torch_mm[0]}.{torch_mm[1]}" if torch_mm else None,
                                    f"CUDA {label_cuda}" if label_cuda else None])) or "no torch/CUDA label"
    problems = []
    if torch_mm and torch_mm != running:
        problems.append(f"built for torch {torch_mm[0]}.{torch_mm[1]}, running {running[0]}.{running[1]}")
    if label_cuda and cuda and label_cuda != cuda:
        problems.append(f"built for CUDA {label_cuda}, torch runs CUDA {cuda}")
    module = _top_level(dist)
    failure = import_check(module, paths) if module else None
    if failure:
        symbol = "undefined symbol" in failure
        if symbol and not problems:
            problems.append(f"MISLABELLED: its label matches this torch but its binary needs another ({failure})")
        else:
            problems.append(f"import fails: {failure}")
    return Verdict(name, dist.version, built, "; ".join(problems) or "matches the running torch", not problems)


def _check_triton(running_torch: metadata.Distribution | None) -> Verdict | None:
    try:
        triton = metadata.distribution("triton")
    except metadata.PackageNotFoundError:
        return None
    pins = [r for r in (running_torch.requires or [] if running_torch else []) if r.startswith("triton")]
    pin = re.search(r"==\s*([\w.]+)", pins[0]) if pins else None
    if pin is None:
        return Verdict("triton", triton.version, "torch pins no triton (a CPU build)",
                       "used by megacpp's Triton kernels on CUDA and by their CPU interpreter tests", True)
    same = public_version(parse_version(pin[1])) == public_version(parse_version(triton.version))
    verdict = ("the version torch was built with" if same else
               f"torch {torch_version()} was built with triton {pin[1]}: Inductor and megacpp's kernels may "
               "miscompile or fail")
    return Verdict("triton", triton.version, f"torch pins triton {pin[1]}", verdict, same)


def audit(paths: Iterable[str] | None = None) -> list[Verdict]:
    """Verdicts for Triton and every compiled torch extension (in `paths`, default: sys.path)."""
    running = (torch_version().release + (0, 0))[:2]
    cuda = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None
    try:
        torch_dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        torch_dist = None
    verdicts = [v for v in [_check_triton(torch_dist)] if v is not None]
    verdicts += [_check_extension(d, running, cuda, paths or []) for d in extension_packages(paths)]
    return verdicts


# ---------------------------------------------------------------- freeze and compare


def _gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [f"{torch.cuda.get_device_name(i)} sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}"
            for i in range(torch.cuda.device_count())]


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _megacpp_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        out = None
    if out is None or out.returncode != 0:
        return f"megacpp {metadata.version('megacpp')} (not a git checkout)"
    return out.stdout.strip() + (" (with local changes)" if dirty.stdout.strip() else "")


def freeze() -> dict[str, Any]:
    """The environment as a JSON-able record."""
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    return {
        "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
        "torch": str(torch_version()), "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "nccl": nccl, "gpus": _gpus(), "driver": _driver(), "megacpp": _megacpp_commit(),
        "packages": {_name(d).lower(): d.version for d in sorted(metadata.distributions(), key=_name)},
    }


def compare(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Every difference between two records, one line each (empty: the same environment)."""
    lines = []
    for key in sorted(set(recorded) | set(current)):
        a, b = recorded.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            for name in sorted(set(a) | set(b)):
                if name not in b:
                    lines.append(f"{key}: {name} {a[name]} is missing here")
                elif name not in a:
                    lines.append(f"{key}: {name} {b[name]} is installed here only")
                elif a[name] != b[name]:
                    lines.append(f"{key}: {name} {a[name]} recorded, {b[name]} here")
        elif a != b:
            lines.append(f"{key}: {a!r} recorded, {b!r} here")
    return lines


def _check_freeze_target(path: Path) -> None:
    """`--freeze` writes a new file or replaces an earlier record (what `read_freeze` accepts), nothing else."""

    if path.is_dir():
        raise UsageError(f"--freeze {path}: is a directory; expected a file path for the record, "
                         f"e.g. {path / 'env.json'}")
    if not path.parent.is_dir():
        raise UsageError(f"--freeze {path}: {path.parent} is not an existing directory; "
                         "create it or choose another path")
    if path.exists() or path.is_symlink():
        try:
            read_freeze(path)
        except ConfigError as exc:
            raise UsageError(f"--freeze {path}: the file exists and is not an environment record written by "
                             "`megacpp doctor --freeze`; not overwriting it "
                             "(remove it or choose another path)") from exc


def write_freeze(path: Path) -> dict[str, Any]:
    """Record the environment in `path`: a new file, or an earlier record, which is replaced."""
    _check_freeze_target(path)
    path = path.resolve() if path.is_symlink() else path  # replace the record a link names, keep the link
    record = freeze()
    try:
        atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    except OSError as exc:  # the OS names the temporary beside `path`, not the path the user gave
        raise MegacppError(f"--freeze {path}: cannot write it ({exc.strerror or exc})") from exc
    return record


def read_freeze(path: Path) -> dict[str, Any]:

    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not an environment record written by `megacpp doctor --freeze` ({exc})") from exc
    if not isinstance(record, dict) or "packages" not in record:
        raise ConfigError(f"{path}: not an environment record written by `megacpp doctor --freeze`")
    return record
