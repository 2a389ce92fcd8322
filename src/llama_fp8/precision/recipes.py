"""The FP8 recipes: one static table, read by the parser (choices and help), the resolver
(``precision.resolve``), preflight, the image's version pins and docs/fp8.md's recipe table
(``recipe_table_markdown``), so that none of them lists recipes by hand.

Every backend's rows are here as data (torchao's and Transformer Engine's, whose FP8 only exists with the
TE model): what each recipe needs in hardware, CUDA, library version, ``--compile`` and FP8 all-gather.
This module imports no FP8 library, no backend and no model, so that parsing flags needs none of them;
the backends (``precision/torchao.py``, ``models/te/fp8/precision.py``) read their rows from here.
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


TORCHAO = "torchao"
TE = "te"
# The Python package each backend needs, in the order ``backends()`` lists them.
LIBRARIES = {TORCHAO: "torchao", TE: "transformer_engine"}

_TORCHAO_SRC = "torchao/float8/config.py (Float8LinearRecipeName), torchao/float8/README.md"
_TE_SRC = ("TE transformer_engine/common/recipe/__init__.py (recipe classes per release), "
           "transformer_engine/pytorch/quantization.py check_*_support (hardware), NVIDIA/TransformerEngine#2245 "
           "(FP8 parameters under FSDP2)")
# TE versions: the first TE release that ships each recipe class; 2.0 is also the oldest TE whose APIs we use
# as written. FP8 parameters (quantized_model_init) under FSDP2 need TE's QuantizedTensor to implement
# fsdp_pre_all_gather / fsdp_post_all_gather: TE 2.10 for Float8Tensor (delayed, current) and MXFP8Tensor.
# Float8BlockwiseQTensor (block) has them since 2.14, but TE's own FSDP2 tests mark block + FP8 weights as failing
# (TransformerEngine/tests/pytorch/distributed/run_fsdp2_model.py), so the TE path refuses it: no FP8 all-gather
# for block here.
RECIPES: tuple[Recipe, ...] = (
    Recipe("tensorwise", TORCHAO, "one scale per tensor (dynamic)", min_library="0.12",
           fp8_all_gather_since="0.12", tensor_parallel=True, emulated_on_cpu=True, default=True,
           source=_TORCHAO_SRC),
    Recipe("rowwise", TORCHAO, "one scale per row of activations and weights (dynamic)", min_library="0.12",
           emulated_on_cpu=True, source=_TORCHAO_SRC),
    Recipe("delayed", TE, "one scale per tensor from an amax history (delayed scaling)",
           min_cuda=(((9, 0), "12.1"),), min_library="2.0", fp8_all_gather_since="2.10", compile=False,
           stateful=True, source=_TE_SRC),
    # TE's default here (TE's own default is delayed scaling): stateless, so a resume is exact with nothing
    # to checkpoint; works under torch.compile; runs on Ada and Hopper; and each scale comes from this
    # step's amax, so a sudden activation spike cannot overflow a scale computed from an older history.
    Recipe("current", TE, "one scale per tensor from its current amax (current scaling)",
           min_cuda=(((9, 0), "12.1"),), min_library="2.2", fp8_all_gather_since="2.10", default=True,
           source=_TE_SRC),
    Recipe("mxfp8", TE, "E8M0 scale per 32 values (MXFP8, Blackwell)", min_capability=(10, 0),
           max_capability=(11, 0), min_library="2.0", fp8_all_gather_since="2.10", source=_TE_SRC),
    Recipe("block", TE, "scale per 1x128 activation / 128x128 weight block", min_capability=(9, 0),
           min_cuda=(((99, 0), "12.9"),), min_library="2.3", source=_TE_SRC),
)


def all_recipes() -> tuple[Recipe, ...]:
    """Every recipe of every backend, torchao's first."""
    return RECIPES


def rows_of(backend: str) -> tuple[Recipe, ...]:
    return tuple(r for r in RECIPES if r.backend == backend)


def backends() -> tuple[str, ...]:
    return tuple(LIBRARIES)


def get(name: str) -> Recipe:
    for r in RECIPES:
        if r.name == name:
            return r
    raise KeyError(f"unknown FP8 recipe {name!r}; known: {', '.join(r.name for r in RECIPES)}")


def default_for(backend: str, compile: bool = False) -> Recipe:
    """What ``--fp8_recipe auto`` means for ``backend``: its default row; under ``--compile 1``, when the
    default does not support torch.compile, the backend's first recipe that does. The only place that
    decides the recipe default (``precision.resolve`` asks it)."""
    rows = rows_of(backend)
    default = next(r for r in rows if r.default)
    if compile and not default.compile:
        return next(r for r in rows if r.compile)
    return default


def supported_on(capability: Capability, cuda: str | None) -> list[Recipe]:
    """Recipes a GPU of this capability runs natively (whatever is installed)."""
    return [r for r in RECIPES if not r.hardware_problem(capability, cuda)]


def backend_help(first_backend: dict[str, str]) -> str:
    """``first_backend``: each model implementation's first FP8 backend (what ``auto`` picks with it)."""
    own = ", ".join(f"{impl}: {backend}" for impl, backend in first_backend.items())
    return f"FP8 library: {', '.join(backends())}; auto: the model implementation's first ({own})"


def recipe_help() -> str:
    parts = [f"{b}: " + "/".join(r.name for r in rows_of(b)) for b in backends()]
    defaults = " / ".join(f"{default_for(b).name} ({b})" for b in backends())
    return f"{'; '.join(parts)}; auto: {defaults}"


def library_of(backend: str) -> str:
    """The Python package an FP8 backend needs (``transformer_engine``, ``torchao``)."""
    return LIBRARIES.get(backend, backend)


def recipe_table_markdown() -> str:
    """docs/fp8.md's FP8 recipe table."""
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
