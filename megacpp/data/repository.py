"""Documents longer than a file: the files of one directory or one repository, joined in include order.

`data.documents` says what one document is:
- ``file``: each file (and each JSONL record) is a document, as before;
- ``directory``: the files directly in one directory, joined;
- ``repository``: the files of one repository, joined. A repository is a directory with a VCS root
  (``.git``, a directory or a worktree's file, or ``.hg``) or a build file (`REPOSITORY_MARKERS`), the
  outermost one on a file's path below a corpus root (a repository nested in another, such as a
  submodule, belongs to the outer one). A corpus root without any such directory is one repository
  itself; when it has some, each file outside all of them is a document alone.

Each file of a joined document starts with a header line, ``// file: <path>`` (`FILE_HEADER`), the path
relative to the repository (to the corpus root for directories and lone files), and ends with a newline
(added when the file has none). Files come in a topological order of the include graph, so a header
comes before the files that include it:
- ``#include "x"`` resolves against the including file's directory first, then the include roots;
  ``#include <x>`` against the include roots only. Include roots are the directories named ``include``
  inside the unit, those on the including file's own path first (nearest first), then the others in
  path order, then the unit's top directory. An include that names no file of the unit adds no edge.
- Ties (files whose includes are all placed) go in path order.
- An include cycle is a strongly connected component of the graph: its files come together, in path
  order, once every file the component includes from outside it is placed.
The order depends on the files' paths and contents only, never on the order a directory lists them in.
"""
from __future__ import annotations

import heapq
import os
import posixpath
import re
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

FILE_HEADER = "// file: {path}\n"
REPOSITORY_MARKERS = frozenset({
    ".git", ".hg",  # VCS roots (.git is a file in a worktree or submodule)
    "CMakeLists.txt", "meson.build", "Makefile", "GNUmakefile", "makefile", "configure.ac", "SConstruct",
    "BUILD", "BUILD.bazel", "WORKSPACE", "WORKSPACE.bazel", "MODULE.bazel",
    "setup.py", "pyproject.toml", "conanfile.py", "conanfile.txt", "vcpkg.json",
})
INCLUDE_DIR_NAME = "include"
# A preprocessor include line; block comments around it are not looked at (a commented-out include adds
# an edge, which can only move a header earlier).
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^">\n]+)[">]', re.MULTILINE)


@dataclass(frozen=True)
class Unit:
    """Files that become one document (before it is cut into parts): their paths relative to `base`."""

    name: str  # what names it, relative to the corpus root: its directory, repository or (lone) file
    base: str  # the directory its header paths are relative to, from the corpus root ("" = the root)
    files: tuple[str, ...]  # relative to base, sorted
    joined: bool  # False: a lone file outside any repository, still written with its header


def repository_dirs(root: Path) -> set[str]:
    """The outermost directories below `root` (itself included, as "") that hold a repository marker,
    as POSIX paths relative to it. Directories that cannot be listed are passed over."""
    found: set[str] = set()
    if not root.is_dir():
        return found
    for dirpath, dirnames, filenames in os.walk(root):
        if REPOSITORY_MARKERS.intersection(dirnames) or REPOSITORY_MARKERS.intersection(filenames):
            rel = Path(dirpath).relative_to(root).as_posix()
            found.add("" if rel == "." else rel)
            dirnames[:] = []  # outermost only: everything below belongs to this repository
    return found


def _parent(rel: str) -> str:
    return posixpath.dirname(rel)


def _ancestors(rel_dir: str) -> list[str]:
    """rel_dir and every directory above it up to the root (""), nearest first."""
    out = [rel_dir]
    while rel_dir:
        rel_dir = _parent(rel_dir)
        out.append(rel_dir)
    return out


def group_files(rels: Iterable[str], mode: str, repositories: AbstractSet[str] = frozenset()) -> list[Unit]:
    """The units that files (POSIX paths relative to a corpus root) form under `mode` ("directory" or
    "repository", with `repositories` from `repository_dirs`), in the order of their first file's path."""
    rels = sorted(rels)
    if mode == "directory":
        keys = {rel: _parent(rel) for rel in rels}
    elif mode == "repository":
        keys = {rel: _repository_of(rel, repositories) for rel in rels}
    else:
        raise ValueError(f"group_files: mode {mode!r} is not 'directory' or 'repository'")
    members: dict[str, list[str]] = {}
    order: list[Unit | str] = []  # units and group keys, in the order of their first file
    for rel in rels:
        key = keys[rel]
        if key is None:
            order.append(Unit(rel, "", (rel,), joined=False))
        elif key not in members:
            members[key] = [rel]
            order.append(key)
        else:
            members[key].append(rel)
    units = []
    for item in order:
        if isinstance(item, Unit):
            units.append(item)
        elif mode == "directory":
            units.append(Unit(item, "", tuple(members[item]), joined=True))
        else:
            files = tuple(posixpath.relpath(rel, item) if item else rel for rel in members[item])
            units.append(Unit(item, item, files, joined=True))
    return units


def _repository_of(rel: str, repositories: AbstractSet[str]) -> str | None:
    """The outermost repository directory on rel's path; the root ("") when there are none at all; None
    when there are some but rel is outside every one."""
    if not repositories:
        return ""
    for directory in reversed(_ancestors(_parent(rel))):  # outermost first
        if directory in repositories:
            return directory
    return None


def include_roots(files: Iterable[str]) -> list[str]:
    """Directories named `include` that hold files of the unit (any depth), sorted; paths relative to the
    unit's top."""
    roots = set()
    for rel in files:
        parts = rel.split("/")[:-1]
        for i, part in enumerate(parts):
            if part == INCLUDE_DIR_NAME:
                roots.add("/".join(parts[: i + 1]))
    return sorted(roots)


class IncludeResolver:
    """Maps an include written in one file of a unit to the unit's file it names (see the module doc)."""

    def __init__(self, files: Iterable[str]) -> None:
        self.files = set(files)
        self.roots = include_roots(self.files)

    def search_dirs(self, includer: str, quoted: bool) -> list[str]:
        here = _parent(includer)
        near = [posixpath.join(d, INCLUDE_DIR_NAME) if d else INCLUDE_DIR_NAME for d in _ancestors(here)]
        root_set = set(self.roots)
        ordered = [d for d in near if d in root_set]
        ordered += [d for d in self.roots if d not in ordered]
        return ([here] if quoted else []) + ordered + [""]

    def resolve(self, includer: str, target: str, quoted: bool) -> str | None:
        for directory in self.search_dirs(includer, quoted):
            candidate = posixpath.normpath(posixpath.join(directory, target))
            if candidate in self.files:
                return candidate
        return None


def includes_of(text: str) -> list[tuple[str, bool]]:
    """(target, quoted) of every include line, in order."""
    return [(m.group(2).strip(), m.group(1) == '"') for m in _INCLUDE.finditer(text)]


def include_graph(texts: Mapping[str, str]) -> dict[str, list[str]]:
    """For each file, the sorted files of the unit it includes (itself left out)."""
    resolver = IncludeResolver(texts)
    graph = {}
    for rel, text in texts.items():
        found = {resolver.resolve(rel, target, quoted) for target, quoted in includes_of(text)}
        graph[rel] = sorted(f for f in found if f is not None and f != rel)
    return graph


def _components(graph: Mapping[str, list[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan's algorithm, iterative), each sorted by path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    out.append(sorted(component))
    return out


def include_order(texts: Mapping[str, str]) -> list[str]:
    """The unit's files, each after the files it includes: a topological order of the include graph with
    ties in path order, every include cycle placed together (see the module doc)."""
    graph = include_graph(texts)
    components = _components(graph)
    component_of = {rel: i for i, members in enumerate(components) for rel in members}
    waiting_on = [set() for _ in components]  # components a component includes, not yet placed
    needed_by: list[set[int]] = [set() for _ in components]
    for rel, deps in graph.items():
        mine = component_of[rel]
        for dep in deps:
            theirs = component_of[dep]
            if theirs != mine:
                waiting_on[mine].add(theirs)
                needed_by[theirs].add(mine)
    ready = [(components[i][0], i) for i in range(len(components)) if not waiting_on[i]]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, i = heapq.heappop(ready)
        order.extend(components[i])
        for j in sorted(needed_by[i]):
            waiting_on[j].discard(i)
            if not waiting_on[j]:
                heapq.heappush(ready, (components[j][0], j))
    return order


@dataclass(frozen=True)
class JoinedFile:
    """Where one file's text lies in a joined document (character offsets, header excluded)."""

    path: str  # as its header line names it
    start: int
    end: int


@dataclass(frozen=True)
class Part:
    text: str
    files: tuple[JoinedFile, ...]


def join_parts(files: list[tuple[str, str]], max_bytes: int) -> list[Part]:
    """(header path, text) in order -> joined documents, cut at file boundaries so each holds at most
    `max_bytes` UTF-8 bytes unless one file alone is longer."""
    parts: list[Part] = []
    pieces: list[str] = []
    spans: list[JoinedFile] = []
    length = nbytes = 0
    for path, text in files:
        header = FILE_HEADER.format(path=path)
        body = text if text.endswith("\n") else text + "\n"
        size = len(header.encode("utf-8")) + len(body.encode("utf-8"))
        if pieces and nbytes + size > max_bytes:
            parts.append(Part("".join(pieces), tuple(spans)))
            pieces, spans, length, nbytes = [], [], 0, 0
        start = length + len(header)
        spans.append(JoinedFile(path, start, start + len(text)))
        pieces += [header, body]
        length, nbytes = length + len(header) + len(body), nbytes + size
    if pieces:
        parts.append(Part("".join(pieces), tuple(spans)))
    return parts
