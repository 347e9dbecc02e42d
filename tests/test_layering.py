"""Package boundaries, checked on the source and on what an import really loads.

Every import runs down: the rooms of the package (its top-level modules and subpackages) stack in
floors, each importing only rooms below it, with one stated exception, the configuration's composition:
`megacpp/config.py` composes the section dataclasses, each defined in the package that reads it
(`megacpp.train.config`, `megacpp.data.config`, ...), including packages that sit above it.

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
    loaded = _fresh_import(module, heavy)
    assert loaded == "[]", f"import {module} loaded {loaded}"


def _fresh_import(module: str, prefixes: str | tuple[str, ...]) -> str:
    """In a fresh interpreter, import `module` and print the sorted loaded modules starting with `prefixes`."""
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return result.stdout.strip()


def _import_graph() -> dict[str, set[str]]:
    modules = _imports_of_package("")  # the whole package
    return {module: {n for n in names if n in modules and n != module} for module, names in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None: depth-first search."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_cycle_finder_finds_a_planted_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_package_has_no_import_cycle():
    """Late (function-level) imports count: a cycle hidden in a function is still one (config.py,
    presets.py, validate.py and data/config.py had one until run_config.py took the layering above them)."""
    assert _find_cycle(_import_graph()) is None


def _room(module: str) -> str:
    """The room a module stands in: ``megacpp.optim.muon`` in ``megacpp.optim``, ``megacpp.cli`` in itself."""
    return ".".join(module.split(".")[:2])


def _is_composition(module: str, imported: str) -> bool:
    """The stated exception: megacpp.config importing a package's section module, ``megacpp.<package>.config``."""
    return module == "megacpp.config" and imported.count(".") == 2 and imported.endswith(".config")


def _room_graph() -> dict[str, set[str]]:
    """Room -> the rooms it imports, the configuration's composition left out."""
    rooms: dict[str, set[str]] = {}
    for module, names in _import_graph().items():
        if module == "megacpp":  # the package's own (empty) __init__
            continue
        found = rooms.setdefault(_room(module), set())
        found.update(_room(n) for n in names if n != "megacpp" and not _is_composition(module, n))
    return {room: deps - {room} for room, deps in rooms.items()}


def test_rooms_and_the_composition_exception_are_what_they_say():
    assert _room("megacpp.optim.muon") == "megacpp.optim" and _room("megacpp.cli") == "megacpp.cli"
    assert _is_composition("megacpp.config", "megacpp.train.config")
    assert not _is_composition("megacpp.config", "megacpp.train.loop")
    assert not _is_composition("megacpp.validate", "megacpp.train.config")


def test_every_import_runs_down_but_the_configuration_composition():
    """The rooms form no circle once megacpp.config's section imports are set aside, so they stack in
    floors with every import running down. A circle names the imports to turn around (the version table
    once lived in compile/ though model/ read it; distributed/ read a constant of train/; the data path
    called the gate its caller had run)."""
    assert _find_cycle(_room_graph()) is None


def test_the_data_package_loads_its_names_on_first_use():
    """`from megacpp.data import X` works for every documented name, and reading the configuration does
    not load the data path (the tokenizer library, the corpus walk, the loaders)."""
    import megacpp.data

    assert all(getattr(megacpp.data, name) is not None for name in megacpp.data.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        megacpp.data.nope  # noqa: B018
    assert _fresh_import("megacpp.config", "megacpp.data") == "['megacpp.data', 'megacpp.data.config']"



def test_the_optim_package_loads_its_names_on_first_use():
    """`from megacpp.optim import X` works for every documented name, and reading the configuration loads
    none of the optimizers (their classes import torch; the gate needs only their specs)."""
    import megacpp.optim

    assert all(getattr(megacpp.optim, name) is not None for name in megacpp.optim.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        megacpp.optim.nope  # noqa: B018
    loaded = _fresh_import("megacpp.run_config", ("megacpp.optim.muon", "megacpp.optim.adamw", "megacpp.optim.stack"))
    assert loaded == "['megacpp.optim.adamw_spec', 'megacpp.optim.muon_spec']"

HELP_PROBE = """
import contextlib, io, sys
from megacpp.cli import main
outputs = {}
for command in ([], ["train"], ["eval"], ["sample"], ["tokenizer", "train"], ["data", "prepare"], ["doctor"],
                ["params"], ["config"], ["compile-report"], ["cache"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*command, "--help"])
    outputs[" ".join(command)] = out.getvalue()
print(repr(("torch" in sys.modules, outputs)))
"""


def test_help_of_every_command_answers_without_importing_torch():
    """`megacpp --help` and `megacpp COMMAND --help` answer in ~0.1 s instead of the ~2 s of importing torch:
    the parser's module imports no torch, each command imports what it needs when it runs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", HELP_PROBE], capture_output=True, text=True, env=env, check=True)
    loaded_torch, outputs = ast.literal_eval(result.stdout.strip())
    assert not loaded_torch
    for command in ("train", "eval", "sample", "tokenizer", "data", "doctor", "params", "config", "compile-report",
                    "cache"):
        assert f"\n    {command}" in outputs[""], f"`megacpp --help` does not list {command}"
    for command, text in outputs.items():
        assert text.startswith(f"usage: megacpp {command}".rstrip()), f"`megacpp {command} --help`: {text[:80]!r}"
    assert "--preset {dense,nam52,small,tiny}" in outputs["config"]
    assert "--resume" in outputs["train"] and "--by-position" in outputs["eval"] and "--top-k" in outputs["sample"]


CONFIG_PROBE = """
import contextlib, io, sys
from megacpp.cli import main
outputs = []
for argv in {commands!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    outputs.append((code, out.getvalue()))
print(repr(("torch" in sys.modules, outputs)))
"""


def test_megacpp_config_and_load_config_answer_without_importing_torch(tmp_path):
    """`megacpp config` (a preset, overrides, a config file), which runs `load_config`, reads and checks a
    configuration without torch (~1.5 s of import): the sections, their rules and the optimizers' specs are torch-free
    modules. What it prints is what `dump_toml` makes of the config this torch-importing process loads."""
    run_toml = tmp_path / "run.toml"
    run_toml.write_text('preset = "small"\n\n[model]\ndepth = 12\n\n[model.moe]\nn_experts = 16\n')
    cases = [
        (["config", "--preset", "tiny"], ("tiny", None, [])),
        (["config", "--preset", "nam52", "--model.depth", "12"], ("nam52", None, [("model.depth", "12")])),
        (["config", "--config", str(run_toml), "--optim.muon_lr", "0.01"],
         (None, run_toml, [("optim.muon_lr", "0.01")])),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    probe = CONFIG_PROBE.format(commands=[argv for argv, _ in cases])
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    loaded_torch, outputs = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert not loaded_torch

    import torch  # noqa: F401  (the comparison runs on the path that has torch loaded)

    from megacpp.config import dump_toml
    from megacpp.run_config import load_config

    for (argv, (preset, path, overrides)), (code, printed) in zip(cases, outputs, strict=True):
        assert code == 0, argv
        assert printed == dump_toml(load_config(preset, path, overrides)[0]), argv
    assert "depth = 12" in outputs[1][1] and "n_experts = 16" in outputs[2][1] and "muon_lr = 0.01" in outputs[2][1]
