"""The FP8 recipes: one table, read by the parser (choices and help), validation, preflight and the
README's recipe table (``recipe_table_markdown``), so that none of them lists recipes by hand.

Each FP8 backend brings its own rows: torchao's are in ``precision/torchao.py``, Transformer Engine's
in ``models/te/recipes.py`` (TE's FP8 only exists with the TE model). This module only gathers them
and answers questions about hardware and versions; it imports no FP8 library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Capability = tuple[int, int]


@dataclass(frozen=True)
class Recipe:
    """One ``--fp8_recipe``: which backend runs it and what it needs."""

    name: str
    backend: str
    description: str
    min_capability: Capability = (8, 9)
    """Lowest compute capability with the FP8 tensor cores this recipe uses (8.9: Ada, 9.0: Hopper)."""
    max_capability: Capability | None = None
    """First compute capability that no longer runs it (None: no upper bound)."""
    min_cuda: tuple[tuple[Capability, str], ...] = ()
    """(capability, CUDA version) pairs: on a GPU below that capability, at least that CUDA is needed."""
    min_library: str = "0"
    """Lowest version of the backend's library (torchao or Transformer Engine) that has the recipe."""
    fp8_all_gather_since: str | None = None
    """Library version from which ``--fp8_all_gather 1`` works with this recipe (None: never)."""
    compile: bool = True
    """Works under ``--compile 1``."""
    tensor_parallel: bool = False
    """Has FP8 tensor-parallel layers (``--tp_size > 1`` with FP8)."""
    emulated_on_cpu: bool = False
    """Runs (slowly, for its numerics) without FP8 hardware."""
    stateful: bool = False
    """Keeps scaling state across steps (an amax history), which checkpoints carry so that a resume continues
    with the same scales."""
    default: bool = False
    """What ``--fp8_recipe auto`` picks for this backend (when nothing else decides)."""
    source: str = ""
    """Where the requirements come from."""

    def hardware_problem(self, capability: Capability, cuda: str | None) -> str:
        """Why this recipe cannot run on a GPU of ``capability`` with ``cuda`` (torch.version.cuda), or ''."""
        if capability < self.min_capability:
            return f"needs compute capability >= {_cap(self.min_capability)}"
        if self.max_capability is not None and capability >= self.max_capability:
            return (f"needs compute capability >= {_cap(self.min_capability)} and < "
                    f"{_cap(self.max_capability)}")
        for below, version in self.min_cuda:
            if capability < below and (cuda is None or version_tuple(cuda) < version_tuple(version)):
                where = "" if below >= (99, 0) else f" on compute capability < {_cap(below)}"
                return f"needs CUDA >= {version}{where}"
        return ""


def _cap(c: Capability) -> str:
    return f"{c[0]}.{c[1]}"


def version_tuple(version: str) -> tuple[int, int, int]:
    """Leading ``major.minor[.patch]`` of a version such as ``2.10.0.dev0+abc`` -> (2, 10, 0)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if m is None:
        raise ValueError(f"cannot parse version {version!r} (expected major.minor[.patch])")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def older(version: str, minimum: str) -> bool:
    return version_tuple(version) < version_tuple(minimum)


def all_recipes() -> tuple[Recipe, ...]:
    """Every recipe of every backend, torchao's first, then the model implementations' own."""
    from llama_fp8 import models
    from llama_fp8.precision import torchao

    rows = list(torchao.RECIPES)
    for impl in models.implementations():
        rows += [r for r in impl.fp8_recipes() if r.backend != torchao.BACKEND]
    return tuple(rows)


def backends() -> tuple[str, ...]:
    return tuple(dict.fromkeys(r.backend for r in all_recipes()))


def get(name: str) -> Recipe:
    for r in all_recipes():
        if r.name == name:
            return r
    raise KeyError(f"unknown FP8 recipe {name!r}; known: {', '.join(r.name for r in all_recipes())}")


def default_for(backend: str) -> Recipe:
    return next(r for r in all_recipes() if r.backend == backend and r.default)


def supported_on(capability: Capability, cuda: str | None) -> list[Recipe]:
    """Recipes a GPU of this capability runs natively (whatever is installed)."""
    return [r for r in all_recipes() if not r.hardware_problem(capability, cuda)]


def backend_help() -> str:
    from llama_fp8 import models

    own = ", ".join(f"{impl.name}: {impl.fp8_backends()[0].name}" for impl in models.implementations()
                    if impl.fp8_backends())
    return f"FP8 library: {', '.join(backends())}; auto: the model implementation's first ({own})"


def recipe_help() -> str:
    parts = [f"{b}: " + "/".join(r.name for r in all_recipes() if r.backend == b) for b in backends()]
    defaults = " / ".join(f"{default_for(b).name} ({b})" for b in backends())
    return f"{'; '.join(parts)}; auto: {defaults}"


def library_of(backend: str) -> str:
    """The Python package an FP8 backend needs (``transformer_engine``, ``torchao``)."""
    from llama_fp8 import models

    for impl in models.implementations():
        for b in impl.fp8_backends():
            if b.name == backend:
                return b.library
    return backend


def recipe_table_markdown() -> str:
    """The README's FP8 recipe table."""
    rows = ["| `--fp8_recipe` | backend | GPU (compute capability) | minimum library | FP8 all-gather | "
            "`--compile 1` | what it scales |", "|---|---|---|---|---|---|---|"]
    for r in all_recipes():
        gpu = f">= {_cap(r.min_capability)}" + (f", < {_cap(r.max_capability)}" if r.max_capability else "")
        for below, version in r.min_cuda:
            gpu += f"; CUDA >= {version}" + ("" if below >= (99, 0) else f" below {_cap(below)}")
        if r.emulated_on_cpu:
            gpu += " (emulated on CPU)"
        gather = f"since {r.fp8_all_gather_since}" if r.fp8_all_gather_since else "no"
        rows.append(f"| `{r.name}`{' (default)' if r.default else ''} | {r.backend} | {gpu} | "
                    f"{library_of(r.backend)} >= {r.min_library} | {gather} | {'yes' if r.compile else 'no'} | "
                    f"{r.description} |")
    return "\n".join(rows)
