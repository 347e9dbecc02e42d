"""`data.corpus = "system"`: every C/C++ header and source tree already on the machine.

The trees, in the order their documents are kept (a file found again in a later tree is a duplicate):
1. torch's headers (the default corpus), so its documents keep their place;
2. the C++ compiler's include directories (``c++ -xc++ -E -v -``), its C++ standard library first;
3. /usr/local/include and /usr/include;
4. installed Python packages' include directories (``site-packages/*/include`` and one level deeper,
   e.g. numpy's ``_core/include``).
A tree inside an earlier one is dropped (its files are already walked); a walk skips the other trees
nested in it, so no directory is read twice. Trees that do not exist are left out; trees that exist
but cannot be listed are counted. Only C/C++ extensions are read, plus the extensionless headers of
C++ standard libraries (``<vector>`` is a file named ``vector`` under a ``c++`` directory).
"""
from __future__ import annotations

import shutil
import site
import subprocess
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

STANDARD_INCLUDE_DIRS = (Path("/usr/local/include"), Path("/usr/include"))
COMPILERS = ("c++", "g++", "clang++")
_SEARCH_START, _SEARCH_END = "#include <...> search starts here:", "End of search list."


def default_corpus_root() -> Path:
    """torch's C++ headers: the default corpus, the same on every machine with this torch."""
    import torch  # imported here: discovery of user corpora does not need torch

    return Path(torch.__file__).parent / "include"


@dataclass(frozen=True)
class SourceTree:
    name: str  # how summaries and document sources name it
    path: Path
    extensionless: bool = False  # also read files without an extension (C++ standard library headers)


def compiler_include_dirs(compilers: Sequence[str] = COMPILERS) -> list[Path]:
    """The first installed compiler's `#include <...>` search path, or [] when none answers."""
    for exe in compilers:
        found = shutil.which(exe)
        if found is None:
            continue
        try:
            out = subprocess.run([found, "-xc++", "-E", "-v", "-"], input="", capture_output=True, text=True,
                                 timeout=30).stderr
        except (OSError, subprocess.SubprocessError):
            continue
        if _SEARCH_START in out:
            listed = out.split(_SEARCH_START, 1)[1].split(_SEARCH_END, 1)[0].splitlines()
            # clang on macOS marks framework directories; they hold no plain include tree.
            return [Path(line.strip()) for line in listed if line.strip() and "(framework" not in line]
    return []


def site_package_dirs() -> list[Path]:
    """Where installed Python packages live (the environment's, then the user's)."""
    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [Path(d) for d in dict.fromkeys(dirs)]


def _package_include_trees(site_dirs: Sequence[Path]) -> list[SourceTree]:
    trees = []
    for base in site_dirs:
        for pattern in ("*/include", "*/*/include"):
            for path in sorted(base.glob(pattern)):
                if path.is_dir():
                    trees.append(SourceTree(f"site-packages/{path.relative_to(base).as_posix()}", path))
    return trees


def _is_cxx_library(path: Path) -> bool:
    return "c++" in path.parts


def system_trees(
    torch_include: Path | None = None,
    compiler_dirs: Sequence[Path] | None = None,
    include_dirs: Sequence[Path] = STANDARD_INCLUDE_DIRS,
    site_dirs: Sequence[Path] | None = None,
) -> list[SourceTree]:
    """The machine's trees in keeping order; every argument left None is looked up (tests pass fakes)."""
    if torch_include is None:
        torch_include = default_corpus_root()
    if compiler_dirs is None:
        compiler_dirs = compiler_include_dirs()
    if site_dirs is None:
        site_dirs = site_package_dirs()
    ordered_compiler = sorted(compiler_dirs, key=lambda p: not _is_cxx_library(p))  # stable: keeps search order
    candidates = [
        SourceTree("torch/include", torch_include),
        *(SourceTree(str(p), p, extensionless=_is_cxx_library(p)) for p in ordered_compiler),
        *(SourceTree(str(p), p) for p in include_dirs),
        *_package_include_trees(site_dirs),
    ]
    return _drop_nested(candidates)


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: keep the name, listing it will fail and be counted
        return path.absolute()


def _drop_nested(trees: list[SourceTree]) -> list[SourceTree]:
    """Leave out absent trees, repeats and trees inside an earlier tree (already walked with it)."""
    kept: list[SourceTree] = []
    for tree in trees:
        if not (tree.path.exists() or tree.path.is_symlink()):
            continue
        path = _resolved(tree.path)
        if any(path == _resolved(k.path) or path.is_relative_to(_resolved(k.path)) for k in kept):
            continue
        kept.append(SourceTree(tree.name, path, tree.extensionless))
    return kept
