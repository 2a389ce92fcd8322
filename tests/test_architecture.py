"""The package's boundaries (docs/architecture.md), checked on its source: no import cycles of any kind, every
import between the package's folders runs down the layer order, and nothing outside ``models/`` names a model
implementation; and what a reader meets: no one-letter module aliases, no path in a comment that does not exist."""

from __future__ import annotations

import ast
import re
import tokenize
from pathlib import Path

import pytest

from helpers import REPO

SRC = REPO / "src" / "llama_fp8"


def module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _with_parents(name: str) -> list[str]:
    """``a.b.c`` -> a, a.b, a.b.c: importing a module imports (runs the ``__init__`` of) every package above it."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imports(path: Path, known: set[str], src: Path = SRC) -> set[str]:
    """Package modules ``path`` imports anywhere: at module level, inside functions and under TYPE_CHECKING
    (a function-level import is a cycle postponed, a typing-only one is a cycle the type checker walks).
    Importing ``a.b`` counts as importing ``a`` too, except for the packages ``path`` itself sits in: those
    are imported before it is, so an edge to them adds nothing."""
    out: set[str] = set()
    here = module_name(path, src)
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.update(_with_parents(a.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = here.split(".") if is_pkg else here.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            out.update(_with_parents(base))
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import submodule` imports it
    return {m for m in out if m in known} - set(_with_parents(here))


def import_cycles(src: Path) -> list[list[str]]:
    files = list(src.rglob("*.py"))
    known = {module_name(p, src) for p in files}
    graph = {module_name(p, src): imports(p, known, src) for p in files}
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
    assert not cycles, "import cycles (module-level, function-level or TYPE_CHECKING):\n" + "\n".join(
        " -> ".join(c) for c in cycles)


# The layer order of docs/architecture.md, lowest first. A top-level module or folder imports only from layers
# strictly below its own; inside one folder its modules may import each other (the cycle check covers them).
LAYERS = (
    ("errors", "faults", "collector"),
    ("data", "parallel", "precision"),
    ("models", "checkpoint", "telemetry"),
    ("config",),
    ("plan",),
    ("train",),
    ("estimate", "convert", "fp8_bisect"),
    ("report",),
    ("cluster", "reference", "publish"),
    ("__main__",),
)


def _room(module: str) -> str:
    """``llama_fp8.cluster.launch.elastic`` -> ``cluster``: the top-level folder or module it belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_up(src: Path, layers=LAYERS) -> list[str]:
    """``a.py -> b`` for every import (module level, in a function or under TYPE_CHECKING) from a layer into its
    own layer's other rooms or a higher one; a room that no layer names is reported too."""
    rank = {room: i for i, layer in enumerate(layers) for room in layer}
    files = list(src.rglob("*.py"))
    known = {module_name(p, src) for p in files}
    bad = []
    for path in sorted(files):
        here = _room(module_name(path, src))
        if here == "__init__" or not here:
            continue
        if here not in rank:
            bad.append(f"{path.relative_to(src.parent)}: {here!r} is in no layer of LAYERS")
            continue
        for mod in sorted(imports(path, known, src)):
            there = _room(mod)
            if there and there != here and rank.get(there, len(layers)) >= rank[here]:
                bad.append(f"{path.relative_to(src.parent)} -> {mod}")
    return bad


def test_imports_run_down_the_layers():
    bad = imports_up(SRC)
    assert not bad, "imports that run up (or across) the layer order of docs/architecture.md:\n" + "\n".join(bad)


def test_the_layer_check_finds_an_import_running_up(tmp_path):
    """Inside a function too: a postponed import is still an arrow up."""
    pkg = _package(tmp_path, {"low/__init__.py": "", "low/a.py": "def f():\n    from pkg.high import b\n",
                              "high/__init__.py": "", "high/b.py": "from pkg.low import a\n"})
    assert imports_up(pkg, layers=(("low",), ("high",))) == ["pkg/low/a.py -> pkg.high", "pkg/low/a.py -> pkg.high.b"]
    assert imports_up(pkg, layers=(("low", "high"),)) != []  # one layer's rooms do not import each other
    assert "pkg/low/a.py: 'low' is in no layer of LAYERS" in imports_up(pkg, layers=(("high",),))


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


@pytest.mark.parametrize(("kind", "files", "cycle"), [
    ("module level", {"a.py": "from pkg import b\n", "b.py": "import pkg.a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
    ("inside a function", {"a.py": "from pkg import b\n", "b.py": "def f():\n    from pkg.a import x\n"},
     ["pkg.a", "pkg.b", "pkg.a"]),
    ("TYPE_CHECKING", {"a.py": "from pkg import b\n",
                       "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"},
     ["pkg.a", "pkg.b", "pkg.a"]),
    # c imports sub.d, which runs sub/__init__.py, which imports c: a cycle although c never names sub itself
    ("a.b counts as a", {"c.py": "from pkg.sub.d import x\n", "sub/__init__.py": "from pkg import c\n",
                         "sub/d.py": "x = 1\n"}, ["pkg.c", "pkg.sub", "pkg.c"]),
])
def test_the_cycle_check_finds_a_planted_cycle(tmp_path, kind, files, cycle):
    assert import_cycles(_package(tmp_path, files)) == [cycle], kind


def test_the_cycle_check_passes_a_package_that_imports_its_own_modules(tmp_path):
    """A package's __init__ re-exporting its modules, which import each other by full name, is no cycle: the
    package is being imported already when they run."""
    pkg = _package(tmp_path, {"sub/__init__.py": "from pkg.sub.d import x\nfrom pkg.sub.e import y\n",
                              "sub/d.py": "x = 1\n", "sub/e.py": "from pkg.sub.d import x\ny = x\n",
                              "f.py": "from pkg.sub import x\n"})
    assert import_cycles(pkg) == []


MAX_LINES = 400


def test_no_module_over_400_lines():
    """One job per room: a module that grows past MAX_LINES is split by responsibility (docs/architecture.md)."""
    long = {str(p.relative_to(REPO)): n for p in [*SRC.rglob("*.py"), *SRC.rglob("*.sh")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_implementation_names_only_inside_models():
    """The acceptance check of the architecture issue: `grep -rn '"te"\\|== "hf"' src/llama_fp8` finds the
    implementation names only inside models/ (the CLI's choices and help come from the registry)."""
    # The FP8 recipe table names Transformer Engine's FP8 backend (whose name is `te` too) once, as data.
    allowed = {("src/llama_fp8/precision/recipes.py", 'TE = "te"')}
    hits = []
    for path in SRC.rglob("*.py"):
        if "models" in path.relative_to(SRC).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r'"te"|== "hf"', line) and (str(path.relative_to(REPO)), line.strip()) not in allowed:
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_every_source_folder_is_a_package_that_installs():
    """A folder without __init__.py is a namespace package, which setuptools' find (pyproject.toml) leaves
    out of a non-editable install: the image (`pip install .`) would lack its modules."""
    from setuptools import find_packages

    found = set(find_packages(str(SRC.parent)))
    folders = {module_name(p.parent / "__init__.py") for p in SRC.rglob("*.py") if "__pycache__" not in p.parts}
    assert folders <= found, folders - found


def one_letter_aliases(src: Path) -> list[str]:
    """``file:line: module as X`` for every import that names a module by one letter (``F`` is torch's functional
    in one file and a checkpoint module in another: a reader must look each one up)."""
    out = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out += [f"{path.relative_to(src.parent)}:{node.lineno}: {a.name} as {a.asname}" for a in node.names
                        if a.asname and len(a.asname) == 1]
    return out


def test_no_one_letter_module_aliases():
    found = one_letter_aliases(SRC)
    assert not found, "one-letter module aliases (name the module):\n" + "\n".join(found)


def test_the_alias_check_finds_one(tmp_path):
    pkg = _package(tmp_path, {"a.py": "import os.path as P\nfrom pkg import b as bee\n",
                              "b.py": "def f():\n    from pkg import a as A\n"})
    assert one_letter_aliases(pkg) == ["pkg/a.py:1: os.path as P", "pkg/b.py:2: a as A"]


# Paths of other projects that comments cite (their sources, their tests): not ours to find.
EXTERNAL_ROOTS = ("transformer_engine/", "TransformerEngine/", "torchao/", "torch/", "transformers/")
PY_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)+[\w.-]+\.py)\b")
BRACES = re.compile(r"([\w./-]*)\{([^{}\s]*,[^{}\s]*)\}")  # a/{b.py,c/d.py}: a/b.py and a/c/d.py


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string (docstrings, messages) in a Python file."""
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    with path.open() as f:
        return [(t.start[0], t.string) for t in tokenize.generate_tokens(f.readline) if t.type in kinds]


def missing_paths(src: Path, repo: Path) -> list[str]:
    """``file:line: path`` for every ``folder/file.py`` a comment or string in ``src`` names that exists neither
    under ``src`` (the package: ``cluster/ngc.py``) nor under ``repo`` (``tests/...``, ``src/llama_fp8/...``)."""
    out = []
    for path in sorted(src.rglob("*.py")):
        for line, text in _texts(path):
            text = BRACES.sub(lambda m: " ".join(m.group(1) + part for part in m.group(2).split(",")), text)
            for name in PY_PATH.findall(text):
                if not name.startswith(EXTERNAL_ROOTS) and not (src / name).exists() and not (repo / name).exists():
                    out.append(f"{path.relative_to(src.parent)}:{line}: {name}")
    return out


def test_paths_named_in_comments_and_docstrings_exist():
    missing = missing_paths(SRC, REPO)
    assert not missing, "paths that do not exist (moved? name where it is now):\n" + "\n".join(missing)


def test_the_path_check_finds_a_stale_path(tmp_path):
    pkg = _package(tmp_path, {"report/__init__.py": "", "report/hardware.py": "",
                              "a.py": '"""Compared in report/environment.py and report/hardware.py."""\n'
                                      "# TE's transformer_engine/pytorch/module/base.py; pkg/{a.py,gone/b.py}\n"
                                      "x = f\"see {1} cluster/launch.py\"\n"})
    assert missing_paths(pkg, tmp_path) == ["pkg/a.py:1: report/environment.py", "pkg/a.py:2: pkg/gone/b.py",
                                            "pkg/a.py:3: cluster/launch.py"]
