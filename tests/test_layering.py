"""Package boundaries, checked on the source and on what an import really loads.

`megacpp.train` and `megacpp.infer` never import each other: what both need (checkpoint format, device,
data bundle, evaluation, generation) lives in `megacpp.runtime`, which imports neither. Reading the
configuration must load neither Dynamo nor DTensor (seconds of import before `megacpp config` answers).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import megacpp

ROOT = Path(megacpp.__file__).parent
REPO = ROOT.parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module an import statement of `path` (a module of `package`) names: ``from a import b``
    counts as a and a.b, relative imports are resolved, and imports under ``if TYPE_CHECKING`` count
    (a cycle there is still one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _imports_of_package(package: str) -> dict[str, set[str]]:
    modules = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = _module_name(path)
        modules[name] = imported_modules(path, name if path.name == "__init__.py" else name.rpartition(".")[0])
    return modules


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{module} imports {name}" for module, names in _imports_of_package(package).items()
                  for name in names if name in forbidden or name.startswith(tuple(f"{f}." for f in forbidden)))


def test_the_import_walker_sees_every_import_form(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("import megacpp.infer.session\nfrom megacpp import infer\nfrom ..infer import generate\n"
                      "from . import loop\nif TYPE_CHECKING:\n    from megacpp.infer.x import y\n")
    names = imported_modules(source, "megacpp.train")
    assert {"megacpp.infer.session", "megacpp.infer", "megacpp.infer.generate", "megacpp.train.loop",
            "megacpp.infer.x"} <= names


@pytest.mark.parametrize(("package", "other"), [("train", "infer"), ("infer", "train")])
def test_train_and_infer_do_not_import_each_other(package, other):
    assert _imports_of_package(package), f"no modules found under megacpp/{package}"
    assert _offenders(package, (f"megacpp.{other}",)) == []


def test_runtime_sits_below_train_and_infer():
    assert _offenders("runtime", ("megacpp.train", "megacpp.infer")) == []


@pytest.mark.parametrize("module", ["megacpp.config", "megacpp.cli"])
def test_importing_the_config_or_the_cli_loads_neither_dynamo_nor_dtensor(module):
    """Each costs about a second of import before `megacpp config` or `--help` can answer. A fresh
    interpreter: this test process has long imported both."""
    heavy = ("torch._dynamo", "torch.distributed.tensor")
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith({heavy!r})))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]", f"import {module} loaded {result.stdout.strip()}"
