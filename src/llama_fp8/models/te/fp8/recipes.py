"""Transformer Engine availability, version/capability checks, FP8 recipes and autocast.

``transformer_engine`` is imported lazily inside functions, so importing this module works on a
machine without TE. The checks and the API selection are pure functions, tested on CPU with fake
capabilities and fake TE modules (tests/models/te/). The recipes' requirements are TE's rows of the
FP8 recipe table (``precision/recipes.py``, which holds them as data).

Every TE name used here was checked in TE's sources (NVIDIA/TransformerEngine tags v2.0 ... v2.18
and main 2.20.0.dev0; NVFP4BlockScaling from v2.8): ``transformer_engine/pytorch/quantization.py`` (fp8.py before 2.9),
``transformer_engine/common/recipe/__init__.py``, ``transformer_engine/pytorch/__init__.py``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Any

from llama_fp8.precision import recipes as recipe_table
from llama_fp8.precision.recipes import Recipe, older, version_tuple

BACKEND = recipe_table.TE
TE_RECIPES: tuple[Recipe, ...] = recipe_table.rows_of(BACKEND)  # TE's rows of the FP8 recipe table
RECIPES = tuple(r.name for r in TE_RECIPES)
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
MIN_TE_FP8_PARAMS_FSDP2 = min((r.fp8_all_gather_since for r in TE_RECIPES if r.fp8_all_gather_since), key=version_tuple)
# te.autocast(recipe=..., amax_reduction_group=...) and te.quantized_model_init appear in TE 2.9;
# older releases have fp8_autocast(fp8_recipe=..., fp8_group=...) and fp8_model_init.
TE_INSTALL_HINT = (
    "Transformer Engine is not importable. To get it, use the NGC PyTorch container "
    "(0.transformer-engine.dockerfile, which ships TE) or "
    "`pip install transformer-engine[pytorch]` "
    "on a CUDA machine; or pass --model_impl hf --fp8_backend torchao."
)


# --------------------------------------------------------------------------- TE import / versions


def te_import() -> Any:
    """Return the ``transformer_engine.pytorch`` module, or raise ImportError saying how to get it.

    ``torch`` is imported first on purpose: TE finds ``libnccl.so.2`` through torch's libraries.
    """
    import torch  # noqa: F401,F811  (order matters, see docstring)

    try:
        import transformer_engine.pytorch as te
    except (ImportError, OSError) as e:  # OSError: a shared library of a partial install is missing
        raise ImportError(f"{TE_INSTALL_HINT} (import error: {e})") from e
    return te


def te_version() -> str | None:
    """Installed TE version from package metadata (no import of TE), or None if not installed."""
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


parse_version = version_tuple


# --------------------------------------------------------------------------- recipe checks (pure)


def row(recipe: str) -> Recipe:
    for r in TE_RECIPES:
        if r.name == recipe:
            return r
    raise ValueError(f"--fp8_recipe {recipe!r} is not one of {', '.join(RECIPES)}")


def check_recipe_supported(
    recipe: str,
    capability: tuple[int, int] | None,
    cuda_version: str | None,
    te_version: str | None,
) -> None:
    """Fail early (before building a model) if ``recipe`` cannot run here.

    ``capability`` is ``torch.cuda.get_device_capability()`` (None: no GPU), ``cuda_version`` is
    ``torch.version.cuda`` and ``te_version`` is :func:`te_version` (None: not installed; then the
    import error reports it). Raises ValueError naming recipe, GPU capability and requirement.
    """
    r = row(recipe)
    if capability is None:
        raise ValueError(
            f"--fp8_recipe {recipe} needs an NVIDIA GPU, but no CUDA device is visible; "
            "use --fp8 0 or --fp8_backend torchao (emulated on CPU)"
        )
    problem = r.hardware_problem(tuple(capability), cuda_version)
    if problem:
        below = tuple(capability) < r.min_capability
        would = " (Blackwell: B200, GB200; TE has no emulation of it)" if r.min_capability >= (10, 0) and below else ""
        raise ValueError(
            f"--fp8_recipe {recipe} {problem}{would}; this GPU is SM {capability[0]}.{capability[1]} "
            f"with CUDA {cuda_version or 'unknown'}{emulated_route(r) if below else ''}"
        )
    if te_version is not None and older(te_version, r.min_library):
        raise ValueError(f"--fp8_recipe {recipe} needs Transformer Engine >= {r.min_library}, found {te_version}")


def emulated_route(r: Recipe) -> str:
    """Where a GPU below the recipe's capability can still run its number format: another backend's row of the
    same format that emulates it (torchao's MXFP8: its quantization in torch ops, dequantized GEMMs), or ''."""
    rows = [x for x in recipe_table.all_recipes() if x.backend != r.backend and x.format == r.format
            and x.emulated_on_cpu]
    if not rows:
        return ""
    x = rows[0]
    return (f"; for {x.format.upper()}'s numerics on this GPU, emulated (its loss, no speed-up): --model_impl hf "
            f"--fp8_backend {x.backend} --fp8_recipe {x.name}")


def check_combination(recipe: str, compile: bool, fp8_params: bool, te_version: str | None) -> None:
    """Reject flag combinations that TE rejects or does not support under FSDP2."""
    r = row(recipe)
    if compile and not r.compile:
        # TE's check_recipe_support raises "DelayedScaling is not supported under torch.compile".
        able = "|".join(x.name for x in TE_RECIPES if x.compile)
        raise ValueError(
            f"--fp8_recipe {recipe} cannot be combined with --compile 1 (TE does not support it under "
            f"torch.compile); use --fp8_recipe {able} or --compile 0"
        )
    if fp8_params:
        minimum = r.fp8_all_gather_since
        if minimum is None:  # block: TE has the hooks (2.14) but its own FSDP2 tests mark them failing
            able = "|".join(x.name for x in TE_RECIPES if x.fp8_all_gather_since)
            raise ValueError(f"FP8 parameters (FP8 all-gather) with --fp8_recipe {recipe} are not offered under FSDP2 "
                             f"(Transformer Engine's own FSDP2 tests mark them failing); use --fp8_recipe {able} or "
                             "turn FP8 parameters off")
        if te_version is None or older(te_version, minimum):
            raise ValueError(
                f"FP8 parameters with --fp8_recipe {recipe} under FSDP2 need Transformer Engine "
                f">= {minimum} (FP8 all-gather), found {te_version or 'none'}; "
                "turn FP8 parameters off or upgrade TE"
            )


# --------------------------------------------------------------------------- recipes and contexts


def recipe_spec(recipe: str, amax_history_len: int, amax_compute_algo: str) -> tuple[str, dict]:
    """(class in ``transformer_engine.common.recipe``, kwargs); ``fp8_format`` as a Format name."""
    row(recipe)
    if recipe == "delayed":
        if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"--fp8_amax_compute_algo {amax_compute_algo!r} is not one of {', '.join(AMAX_COMPUTE_ALGOS)}"
            )
        if amax_history_len < 1:
            raise ValueError(f"--fp8_amax_history_len must be >= 1, got {amax_history_len}")
        kwargs = {
            "fp8_format": "HYBRID",  # E4M3 forward, E5M2 gradients
            "amax_history_len": amax_history_len,
            "amax_compute_algo": amax_compute_algo,
        }
        return "DelayedScaling", kwargs
    if recipe == "current":
        return "Float8CurrentScaling", {"fp8_format": "HYBRID"}
    if recipe == "mxfp8":
        return "MXFP8BlockScaling", {}  # TE default: E4M3, 1x32 blocks with E8M0 scales
    if recipe == "nvfp4":
        # TE defaults (transformer_engine/common/recipe/__init__.py): E2M1 values, E4M3 scales per 16 (16x16 blocks for weights), random
        # Hadamard transforms and stochastic rounding of gradients, as NVIDIA's NVFP4 pretraining recipe
        return "NVFP4BlockScaling", {}
    return "Float8BlockScaling", {}  # TE default: E4M3, 1x128 activations, 128x128 weights


def make_recipe(recipe: str, amax_history_len: int = 1024, amax_compute_algo: str = "max") -> Any:
    """Build the TE recipe object for ``--fp8_recipe``."""
    name, kwargs = recipe_spec(recipe, amax_history_len, amax_compute_algo)
    te_import()
    from transformer_engine.common import recipe as te_recipe

    if "fp8_format" in kwargs:
        kwargs = {**kwargs, "fp8_format": getattr(te_recipe.Format, kwargs["fp8_format"])}
    return getattr(te_recipe, name)(**kwargs)


def select_autocast(te_module: Any) -> tuple[str, tuple[str, str, str]]:
    """Autocast function of the installed TE: (name, kwarg names for enabled, recipe, group)."""
    if hasattr(te_module, "autocast"):  # TE >= 2.9
        return "autocast", ("enabled", "recipe", "amax_reduction_group")
    if hasattr(te_module, "fp8_autocast"):  # TE < 2.9 (deprecated alias afterwards)
        return "fp8_autocast", ("enabled", "fp8_recipe", "fp8_group")
    raise ImportError("transformer_engine.pytorch has neither autocast nor fp8_autocast")


def select_quantized_init(te_module: Any) -> str:
    """Name of TE's FP8-parameter context: quantized_model_init (>= 2.9) or fp8_model_init."""
    for name in ("quantized_model_init", "fp8_model_init"):
        if hasattr(te_module, name):
            return name
    raise ImportError("transformer_engine.pytorch has neither quantized_model_init nor fp8_model_init")


def autocast(
    enabled: bool, recipe: Any, amax_group: Any = None, te_module: Any = None
) -> contextlib.AbstractContextManager:
    """TE FP8 autocast for the forward pass. ``amax_group``: the data-parallel process group, so
    every rank that holds a replica of a weight agrees on its scale."""
    te = te_module if te_module is not None else te_import()
    name, (k_enabled, k_recipe, k_group) = select_autocast(te)
    return getattr(te, name)(**{k_enabled: enabled, k_recipe: recipe, k_group: amax_group})


def quantized_init(enabled: bool, recipe: Any, te_module: Any = None) -> contextlib.AbstractContextManager:
    """Context under which TE modules are created with FP8 (quantized) primary weights."""
    te = te_module if te_module is not None else te_import()
    return getattr(te, select_quantized_init(te))(enabled=enabled, recipe=recipe)
