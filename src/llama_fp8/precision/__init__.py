"""One precision interface, three kinds: bf16 (or fp32), torchao FP8, an implementation's own FP8.

The build calls ``convert(model)`` (on the meta model, before sharding); the loop calls ``autocast()``
around the forward pass, ``post_step(model)`` after the optimizer step and ``report(writer, step)`` after
each step (``Runtime`` lists every method), and nothing else FP8-specific. Only
this package and ``models/te/`` (Transformer Engine's FP8, which exists only with the TE model) know
FP8 exists. Which recipes exist and what they need is the table in ``precision/recipes.py``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from llama_fp8.errors import ConfigError
from llama_fp8.precision import recipes as recipe_table
from llama_fp8.precision.recipes import Recipe

# The config imports this package (the recipe table): commands that only read flags (the A/B schedule) start without
# torch's import, about 1 s of CPU each; the annotations name torch's types only for the type checker.
if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision decision of a run (part of the frozen plan). ``name`` labels the run in logs and reports."""

    name: str
    backend: str  # "none" or an FP8 backend's name
    recipe: str | None = None
    emulated: bool = False
    all_gather: bool = False  # FP8 all-gather of FSDP parameters
    exclude: tuple[str, ...] = ()  # --fp8_exclude: module-name globs kept in high precision (precision/exclude.py)
    verify: str = "error"  # --fp8_verify: stop (error) or warn when FP8 is asked and not on (precision/verify.py)
    stats_every: int = 0  # --fp8_stats: per-layer FP8 numerics every N steps (precision/fp8_stats.py)
    format: str = ""  # the GEMMs' number format (recipes.FORMATS; "" without FP8): which peak MFU is measured against
    reason: str = ""  # why this backend and recipe: asked by a flag, or what auto saw
    bf16_tail: str = ""  # --fp8_exclude last:...: the decoder blocks kept in BF16, in words
    notes: tuple[str, ...] = ()  # what the run should know at start (printed once, kept in config.yaml)


EAGER_NOTE = ("--fp8_recipe {recipe} ({backend}) runs eager (--compile 0): torchao's low-precision layers then run "
              "their casts, scales and matmuls as separate kernels and are slower than BF16 - measured on an H100 "
              "(pytorch/ao#2262): a step took 0.184 s with float8 eager against 0.130 s in BF16 eager, and torchtitan "
              "needs torch.compile for its published speed-ups (pytorch/torchtitan#1191). Use --compile 1 (every arm "
              "of an A/B alike)")


class Runtime(Protocol):
    """A run's precision as the build and the loop use it (``build``): ``Plain`` or an FP8 backend's runtime.
    ``Plain`` documents each method."""

    def convert(self, model: nn.Module) -> nn.Module: ...
    def autocast(self) -> contextlib.AbstractContextManager: ...
    def model_init_context(self) -> contextlib.AbstractContextManager: ...
    def prepare(self, model: nn.Module) -> None: ...
    def optimizer(self, param_groups: list[dict], **kwargs) -> torch.optim.Optimizer | None: ...
    def post_step(self, model: nn.Module) -> None: ...
    def report(self, writer, step: int) -> None: ...


class Fp8Backend(Protocol):
    """An FP8 library as the loop sees it: its recipes, its checks, its runtime."""

    name: str
    recipes: tuple[Recipe, ...]
    library: str  # the Python package it needs

    def library_version(self) -> str:
        """The installed library's version; ImportError (saying how to install it) when it is missing."""

    def check(self, cfg, recipe: Recipe, device: torch.device, world_size: int) -> bool:
        """Raise ConfigError for what cannot run here; return True when FP8 is emulated. Makes ``check_flags``'s
        refusals too."""

    def check_flags(self, cfg, recipe: Recipe) -> None:
        """Raise ConfigError for what this backend refuses in the flags alone, whatever the library version and
        the GPU (an estimate makes these on a machine without the library)."""

    def runtime(self, choice: PrecisionChoice, cfg, run_dir: Path | None = None) -> Runtime:
        """``run_dir``: where a backend may keep its own logs (TE's debug API, with --fp8_stats)."""


class Plain:
    """BF16/FP32: nothing to convert, no autocast (FSDP2's mixed-precision policy casts parameters)."""

    def convert(self, model: nn.Module) -> nn.Module:
        return model

    def autocast(self):
        return contextlib.nullcontext()

    def model_init_context(self):
        return contextlib.nullcontext()

    def prepare(self, model: nn.Module) -> None:
        """Once the model is materialized and initialized, before a checkpoint is loaded into it."""
        return None

    def optimizer(self, param_groups: list[dict], **kwargs):
        """An optimizer this precision needs (e.g. FP32 masters for FP8 weights); None: the configured one."""
        return None

    def post_step(self, model: nn.Module) -> None:
        return None

    def report(self, writer, step: int) -> None:
        """After each step, FP8 runtimes hand their check and statistics records to the metrics writer."""
        return None


def resolve(cfg, impl, device: torch.device | None, world_size: int = 1, others: tuple = ()) -> PrecisionChoice:
    """The one precision decision, made before any model is built: pick the backend and recipe for model
    implementation ``impl`` and check them. ``auto`` picks the implementation's first FP8 backend and that
    backend's default from the recipe table (``recipes.default_for``). The installed library must have
    the recipe and the options asked for (the table's minimum versions); with a ``device``, the backend
    also checks the hardware (``device=None``: preflight on a node that is not the training device).
    ``others``: every model implementation, to name the one a backend needs. Raises ConfigError naming the
    flag; the plan and preflight come here, config validation to ``check_asked``."""
    plain = "bf16" if cfg.bf16 else "fp32"
    if not cfg.fp8:
        return PrecisionChoice(name=plain, backend="none")
    backend, recipe, reason = _choose(cfg, impl, others, capability_of(device))
    emulated = False
    if device is not None:
        emulated = backend.check(cfg, recipe, device, world_size)
    _check_table_rules(cfg, recipe, impl, world_size)
    check_library(backend, recipe, cfg.fp8_all_gather)
    from llama_fp8.precision import exclude

    notes = (EAGER_NOTE.format(recipe=recipe.name, backend=backend.name),) if (
        recipe.needs_compile and not cfg.compile and not emulated and device is not None) else ()
    tail = exclude.tail_text(exclude.tail_layers(cfg.fp8_exclude, cfg.num_layers), cfg.num_layers)
    return PrecisionChoice(name=f"fp8-{backend.name}-{recipe.name}", backend=backend.name, recipe=recipe.name,
                           emulated=emulated, all_gather=cfg.fp8_all_gather,
                           exclude=exclude.parse(cfg.fp8_exclude, cfg.num_layers), verify=cfg.fp8_verify,
                           stats_every=cfg.fp8_stats, format=recipe.format, reason=reason, bf16_tail=tail, notes=notes)


def capability_of(device: torch.device | None) -> tuple[int, int] | None:
    """The GPU's compute capability (None: no GPU, or a decision made away from it)."""
    if device is None or device.type != "cuda":
        return None
    import torch

    return tuple(torch.cuda.get_device_capability(device))


def check_flags(cfg, impl, others: tuple = ()) -> None:
    """The precision refusals ``resolve`` makes that need neither the FP8 library nor the GPU: the backend and the
    recipe for ``impl``, the recipe's dimension rules, and what the backend refuses in the flags alone. For a
    decision made away from the training node (``llama_fp8 estimate`` on a login node without Transformer Engine)."""
    if not cfg.fp8:
        return
    backend, recipe, _ = _choose(cfg, impl, others)
    backend.check_flags(cfg, recipe)
    _check_table_rules(cfg, recipe, impl)


def choose(cfg, impl, others: tuple = (), capability: tuple[int, int] | None = None) -> tuple[Fp8Backend, Recipe, str]:
    """(the FP8 backend, its recipe, why) that ``--fp8 1`` runs with ``impl`` on a GPU of ``capability``: the
    decision ``resolve`` makes, without its checks (the A/B preset asks it, ``cluster/launch/schedule.py``)."""
    return _choose(cfg, impl, others, capability)


def _check_table_rules(cfg, recipe: Recipe, impl, world_size: int | None = None) -> None:
    """What the recipe table says a recipe needs of the flags, whatever the backend: BF16 compute, its dimension
    rules on this implementation's shapes (the --fp8_exclude layers left out)."""
    from llama_fp8.precision import dims, exclude

    if recipe.bf16_only and not cfg.bf16:
        raise ConfigError(f"--fp8_recipe {recipe.name} ({recipe.backend}) quantizes from BF16 inputs only; use --bf16 1")
    dims.check(cfg, recipe, impl.gemm_shapes(cfg), exclude.parse(cfg.fp8_exclude, cfg.num_layers), world_size)


def check_asked(cfg) -> None:
    """What ``resolve`` refuses that the flags decide before a model implementation is chosen: with a named
    ``--fp8_backend``, a ``--fp8_recipe`` of another backend. Config validation (``config.rules.resolve``) asks
    this, so that such a command line is refused as it is parsed; the rest waits for the plan."""
    if cfg.fp8 and cfg.fp8_backend != "auto":
        _choose_recipe(cfg.fp8_backend, cfg.fp8_recipe, cfg.compile)


def _choose(cfg, impl, others: tuple, capability: tuple[int, int] | None = None) -> tuple[Fp8Backend, Recipe, str]:
    backend = _backend(cfg, impl, others)
    recipe, why = _choose_recipe(backend.name, cfg.fp8_recipe, cfg.compile, capability)
    how = "asked (--fp8_backend)" if cfg.fp8_backend != "auto" else f"the first of --model_impl {impl.name}"
    return backend, recipe, f"backend {backend.name}: {how}; recipe {recipe.name}: {why}"


def _choose_recipe(backend: str, asked: str, compile: bool, capability: tuple[int, int] | None = None
                   ) -> tuple[Recipe, str]:
    """The recipe decision, and why: ``--fp8_recipe`` for ``--fp8_backend backend``. ``auto`` is the table's choice
    for a GPU of ``capability`` (``recipes.auto_choice``); a named recipe must belong to the backend. Needs no
    implementation and no library."""
    if asked == "auto":
        return recipe_table.auto_choice(backend, compile, capability)
    mine = {r.name: r for r in recipe_table.rows_of(backend)}
    if asked not in mine:
        owners = [r.backend for r in recipe_table.all_recipes() if r.name == asked]
        raise ConfigError(f"--fp8_recipe {asked} is a recipe of --fp8_backend {' and '.join(owners)}; with "
                          f"--fp8_backend {backend} use one of {', '.join(mine)}")
    return mine[asked], "asked (--fp8_recipe)"


def check_library(backend: Fp8Backend, recipe: Recipe, all_gather: bool) -> str:
    """The installed library's version, if it has ``recipe`` (and FP8 all-gather when asked for); else a
    ConfigError naming what needs which version. An unknown version passes."""
    try:
        version = backend.library_version()
    except Exception as e:  # noqa: BLE001 - TE raises OSError/RuntimeError on a partial install too
        raise ConfigError(f"--fp8_backend {backend.name}: {backend.library} not importable ({type(e).__name__}: "
                          f"{str(e)[:160]})") from None
    needs = [(f"--fp8_recipe {recipe.name}", recipe.min_library)]
    if all_gather:
        needs.append(("--fp8_all_gather 1", recipe.fp8_all_gather_since))
    missing = [f"{what} does not work with --fp8_recipe {recipe.name}" if minimum is None else
               f"{what} needs {backend.library} >= {minimum}" for what, minimum in needs
               if minimum is None or (version != "unknown" and recipe_table.older(version, minimum))]
    if missing:
        raise ConfigError(f"{'; '.join(missing)} (installed: {backend.library} {version})")
    return version


def _backend(cfg, impl, others: tuple) -> Fp8Backend:
    mine = {b.name: b for b in impl.fp8_backends()}
    if not mine:
        raise ConfigError(f"--fp8 1: --model_impl {impl.name} has no FP8 backend; use --fp8 0")
    if cfg.fp8_backend == "auto":
        return next(iter(mine.values()))
    if cfg.fp8_backend not in mine:
        able = [i.name for i in others if cfg.fp8_backend in {b.name for b in i.fp8_backends()}]
        raise ConfigError(f"--fp8_backend {cfg.fp8_backend} does not work with --model_impl {impl.name} (its FP8 "
                          f"backends: {', '.join(mine)}); --fp8_backend {cfg.fp8_backend} needs --model_impl "
                          f"{' or '.join(able) or '?'}")
    return mine[cfg.fp8_backend]


def fp8_collectives(choice: PrecisionChoice) -> bool:
    """Whether tensor parallelism may all-gather and reduce-scatter in FP8: a recipe with FP8 tensor-parallel
    layers, on real FP8 hardware (emulation runs on CPU, whose gloo has no float8 type)."""
    return (choice.backend != "none" and not choice.emulated
            and recipe_table.get(choice.recipe, choice.backend).tensor_parallel)


def build(choice: PrecisionChoice, impl, cfg, run_dir: Path | None = None) -> Runtime:
    """The runtime (``Runtime``) for a choice; made before the model is built (a backend may have to set itself
    up before its modules exist)."""
    if choice.backend == "none":
        return Plain()
    backend = next(b for b in impl.fp8_backends() if b.name == choice.backend)
    return backend.runtime(choice, cfg, run_dir)
