"""The package's boundaries (docs/architecture.md), checked on its source: no module-level import cycles, and
nothing outside ``models/`` names a model implementation."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import REPO

SRC = REPO / "src" / "llama_fp8"


def module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(path: Path, known: set[str], src: Path = SRC) -> set[str]:
    """Package modules imported when ``path`` is imported (not inside functions or TYPE_CHECKING)."""
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    here = module_name(path, src)
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else []:
            if isinstance(sub, ast.Import):
                out.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    pkg = here.split(".") if is_pkg else here.split(".")[:-1]
                    base = ".".join(pkg[:len(pkg) - sub.level + 1] + ([base] if base else []))
                for a in sub.names:  # `from pkg import submodule` imports the submodule (pkg is loading already)
                    out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in out if m in known and m != here}


def import_cycles(src: Path) -> list[list[str]]:
    files = list(src.rglob("*.py"))
    known = {module_name(p, src) for p in files}
    graph = {module_name(p, src): module_level_imports(p, known, src) for p in files}
    cycles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if nxt in stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif state.get(nxt) is None:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for mod in sorted(graph):
        if state.get(mod) is None:
            visit(mod, [mod])
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(SRC)
    assert not cycles, "module-level import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
                              "def f():\n    from pkg import a\nfrom pkg.a import x\n")
    (pkg / "c.py").write_text("from pkg import b\n")
    assert import_cycles(pkg) == [["pkg.a", "pkg.b", "pkg.a"]]  # not b -> c (typing only), nor f's import


def test_implementation_names_only_inside_models():
    """The acceptance check of the architecture issue: `grep -rn '"te"\\|== "hf"' src/llama_fp8` finds the
    implementation names only inside models/ (the CLI's choices and help come from the registry)."""
    hits = []
    for path in SRC.rglob("*.py"):
        if "models" in path.relative_to(SRC).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r'"te"|== "hf"', line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_every_source_folder_is_a_package_that_installs():
    """A folder without __init__.py is a namespace package, which setuptools' find (pyproject.toml) leaves
    out of a non-editable install: the image (`pip install .`) would lack its modules."""
    from setuptools import find_packages

    found = set(find_packages(str(SRC.parent)))
    folders = {module_name(p.parent / "__init__.py") for p in SRC.rglob("*.py") if "__pycache__" not in p.parts}
    assert folders <= found, folders - found
