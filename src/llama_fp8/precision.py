"""One precision interface, three backends: bf16 (or fp32), torchao FP8, Transformer Engine FP8.

train.py calls ``convert(model)``, ``autocast()`` around the forward pass, and ``post_step(model)``
after the optimizer step, and nothing else FP8-specific. Only this file and te_llama.py know FP8 exists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from llama_fp8.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have FP8 tensor cores
TORCHAO_RECIPES = ("tensorwise", "rowwise")
TE_RECIPES = ("delayed", "current", "mxfp8", "block")


def torchao_import():
    """torchao.float8, or an ImportError that says how to get it."""
    try:
        import torchao.float8 as ao_float8
    except ImportError as e:
        raise ImportError("torchao is not installed: `pip install 'llama-fp8[torchao]'` (or `pip install torchao`)"
                          ) from e
    return ao_float8


def device_capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


@dataclass
class Precision:
    """What the loop needs from a precision backend. ``name`` labels the run in logs and reports."""

    name: str
    backend: str  # "none" | "torchao" | "te"
    recipe: str | None = None
    emulated: bool = False
    all_gather: bool = False  # FP8 all-gather of FSDP parameters
    _te_recipe: object | None = field(default=None, repr=False)

    def convert(self, model: nn.Module) -> nn.Module:
        """Swap layers for their FP8 versions (torchao), before sharding, on the meta model."""
        if self.backend == "torchao":
            return _torchao_convert(model, self.recipe, self.emulated, self.all_gather)
        return model

    def autocast(self):
        """Context for the forward pass only (TE: FP8 autocast; backward runs outside it, as TE asks)."""
        if self.backend == "te":
            import torch.distributed as dist

            from llama_fp8 import te_llama

            return te_llama.autocast(True, self._te_recipe, dist.group.WORLD if dist.is_initialized() else None)
        return contextlib.nullcontext()

    def model_init_context(self):
        """Context for building the model: TE with --fp8_all_gather creates FP8 primary weights (so FSDP2
        all-gathers FP8); nothing otherwise."""
        if self.backend == "te" and self.all_gather:
            from llama_fp8 import te_llama

            return te_llama.quantized_init(True, self._te_recipe)
        return contextlib.nullcontext()

    def post_step(self, model: nn.Module) -> None:
        """After optimizer.step(): with torchao FP8 all-gather, compute every weight's FP8 scale for the
        next all-gather in one fused pass (instead of one all-reduce per layer during forward)."""
        if self.backend == "torchao" and self.all_gather:
            torchao_import().precompute_float8_dynamic_scale_for_fsdp(model)


def resolve(cfg: TrainConfig, model_impl: str, device: torch.device, world_size: int = 1) -> Precision:
    """Pick the backend and recipe and check the hardware before any model is built."""
    plain = "bf16" if cfg.bf16 else "fp32"
    if not cfg.fp8:
        return Precision(name=plain, backend="none")
    backend = cfg.fp8_backend
    capability = device_capability(device)
    if backend == "auto":
        backend = "te" if model_impl == "te" else "torchao"
    if backend == "te":
        return _resolve_te(cfg, model_impl, device, capability)
    if model_impl == "te":
        raise ConfigError("--fp8_backend torchao converts nn.Linear layers, but --model_impl te builds Transformer "
                          "Engine layers: use --fp8_backend te, or --model_impl hf")
    recipe = "tensorwise" if cfg.fp8_recipe == "auto" else cfg.fp8_recipe
    if recipe not in TORCHAO_RECIPES:
        raise ConfigError(f"--fp8_recipe {recipe} is not a torchao recipe; valid with torchao: "
                          f"{', '.join(TORCHAO_RECIPES)}")
    torchao_import()
    if cfg.fp8_all_gather and recipe != "tensorwise":
        raise ConfigError(f"--fp8_all_gather 1 works with the tensorwise recipe only (one scale per weight can be "
                          f"computed before the all-gather); got --fp8_recipe {recipe}")
    if cfg.fp8_all_gather and device.type == "cpu" and world_size > 1:
        raise ConfigError("--fp8_all_gather 1 needs NCCL: gloo (CPU) has no float8 dtype to all-gather; on CPU it "
                          "runs with one process only")
    emulated = capability is None or capability < FP8_MIN_CAPABILITY
    if emulated:
        where = "CPU" if capability is None else f"{torch.cuda.get_device_name(device)} (SM {capability[0]}.{capability[1]})"
        log.warning("FP8 is EMULATED on %s (no FP8 tensor cores): loss is representative, speed numbers are "
                    "meaningless", where)
    return Precision(name=f"fp8-torchao-{recipe}", backend="torchao", recipe=recipe, emulated=emulated,
                     all_gather=cfg.fp8_all_gather)


def _resolve_te(cfg: TrainConfig, model_impl: str, device: torch.device,
                capability: tuple[int, int] | None) -> Precision:
    from llama_fp8 import te_llama

    if model_impl != "te":
        raise ConfigError("--fp8_backend te needs the Transformer Engine model: add --model_impl te (or auto on a "
                          "CUDA node with TE); the Hugging Face model's nn.Linear layers are not TE modules")
    # auto: delayed scaling (TE's long-standing default), or current scaling under torch.compile,
    # which TE does not support with delayed scaling.
    recipe = ("current" if cfg.compile else "delayed") if cfg.fp8_recipe == "auto" else cfg.fp8_recipe
    if recipe not in TE_RECIPES:
        raise ConfigError(f"--fp8_recipe {recipe} is not a Transformer Engine recipe; valid with te: "
                          f"{', '.join(TE_RECIPES)}")
    try:
        te_llama.te_import()
    except ImportError as e:
        raise ConfigError(f"--fp8_backend te: {e}") from None
    if capability is None:
        raise ConfigError("--fp8_backend te needs a CUDA GPU with FP8 (SM >= 8.9); on CPU use --fp8_backend torchao "
                          "(emulated)")
    try:
        te_llama.check_recipe_supported(recipe, capability, torch.version.cuda, te_llama.te_version())
    except ValueError as e:
        raise ConfigError(f"--fp8_recipe {recipe} on {torch.cuda.get_device_name(device)}: {e}") from None
    try:
        te_llama.check_combination(recipe, cfg.compile, cfg.fp8_all_gather, te_llama.te_version())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    te_recipe = te_llama.make_recipe(recipe, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo)
    return Precision(name=f"fp8-te-{recipe}", backend="te", recipe=recipe, all_gather=cfg.fp8_all_gather,
                     _te_recipe=te_recipe)


def fp8_linear_filter(module: nn.Module, fqn: str) -> bool:
    """torchao conversion filter: Linear layers only, not the output head, dims divisible by 16
    (FP8 GEMMs need 16-aligned dims)."""
    if not isinstance(module, nn.Linear):
        return False
    if fqn == "lm_head" or fqn.endswith(".lm_head") or fqn == "output":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def _torchao_convert(model: nn.Module, recipe: str, emulated: bool, all_gather: bool = False) -> nn.Module:
    ao = torchao_import()
    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(recipe), emulate=emulated,
                                 enable_fsdp_float8_all_gather=all_gather)
    total = sum(isinstance(m, nn.Linear) for m in model.modules())
    ao.convert_to_float8_training(model, config=config, module_filter_fn=fp8_linear_filter)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    log.info("torchao FP8 (%s%s): converted %d/%d linears", recipe, ", emulated" if emulated else "",
             converted, total)
    return model
