"""torchao FP8 (``Float8Linear``): works on any model built of ``nn.Linear`` layers, emulated on CPU.

The conversion happens on the meta model, before sharding; ``--fp8_all_gather 1`` (tensorwise) makes
FSDP2 all-gather the FP8 weights, whose scales are then computed for all layers in one pass after each
optimizer step (``post_step``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from llama_fp8.errors import ConfigError
from llama_fp8.precision import Plain, fp8_stats
from llama_fp8.precision import exclude as exclude_globs
from llama_fp8.precision import recipes as recipe_table
from llama_fp8.precision import verify as fp8_verify
from llama_fp8.precision.recipes import Recipe

log = logging.getLogger(__name__)

BACKEND = recipe_table.TORCHAO
RECIPES = recipe_table.rows_of(BACKEND)  # torchao's rows of the FP8 recipe table


def torchao_import():
    """torchao.float8, or an ImportError that says how to get it."""
    try:
        import torchao.float8 as ao_float8
    except ImportError as e:
        raise ImportError("torchao is not installed: `pip install 'llama-fp8[torchao]'` (or `pip install torchao`)"
                          ) from e
    return ao_float8


class TorchaoBackend:
    """torchao as an FP8 backend (``precision.Fp8Backend``)."""

    name = BACKEND
    recipes = RECIPES
    library = recipe_table.library_of(BACKEND)

    def library_version(self) -> str:
        torchao_import()
        import torchao

        return getattr(torchao, "__version__", "unknown")

    def check(self, cfg, recipe: Recipe, device: torch.device, world_size: int) -> bool:
        return check(cfg, recipe, device, world_size)

    def check_flags(self, cfg, recipe: Recipe) -> None:
        check_flags(cfg, recipe)

    def runtime(self, choice, cfg, run_dir=None) -> TorchaoFp8:  # its statistics go through the writer
        return TorchaoFp8(choice.recipe, choice.emulated, choice.all_gather, choice.exclude, choice.verify,
                          choice.stats_every)


def check(cfg, recipe: Recipe, device: torch.device, world_size: int) -> bool:
    """Refuse what torchao cannot do here; returns True when FP8 will be emulated (no FP8 tensor cores)."""
    try:
        torchao_import()
    except ImportError as e:
        raise ConfigError(f"--fp8_backend {BACKEND}: {e}") from None
    check_flags(cfg, recipe)
    # On CPU, gloo has no float8 type, but FSDP2 packs a unit's mixed-dtype all-gather inputs (FP8 weights and
    # the block's norm weights) into one uint8 buffer, which gloo carries: emulated FP8 all-gather runs on 2+ ranks.
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    emulated = capability is None or capability < recipe.min_capability
    if emulated:
        where = "CPU" if capability is None else f"{torch.cuda.get_device_name(device)} (SM {capability[0]}.{capability[1]})"
        log.warning("FP8 is EMULATED on %s (no FP8 tensor cores): loss is representative, speed numbers are "
                    "meaningless", where)
    return emulated


def check_flags(cfg, recipe: Recipe) -> None:
    """What torchao's FP8 refuses in the flags alone (no library, no GPU needed)."""
    if cfg.fp8_all_gather and not recipe.fp8_all_gather_since:
        able = ", ".join(r.name for r in RECIPES if r.fp8_all_gather_since)
        raise ConfigError(f"--fp8_all_gather 1 works with the {able} recipe only (one scale per weight can be "
                          f"computed before the all-gather); got --fp8_recipe {recipe.name}")
    if cfg.tp_size > 1 and not recipe.tensor_parallel:
        able = ", ".join(r.name for r in RECIPES if r.tensor_parallel)
        raise ConfigError(f"--fp8_recipe {recipe.name} with --tp_size {cfg.tp_size}: torchao's FP8 tensor-parallel "
                          f"layers scale whole tensors; use --fp8_recipe {able}")


def fp8_linear_filter(module: nn.Module, fqn: str) -> bool:
    """torchao conversion filter: Linear layers only, not the output head, dims divisible by 16
    (FP8 GEMMs need 16-aligned dims)."""
    if not isinstance(module, nn.Linear):
        return False
    if fqn == "lm_head" or fqn.endswith(".lm_head") or fqn == "output":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def why_high_precision(module: nn.Module, fqn: str, exclude: tuple[str, ...] = ()) -> str | None:
    """Why an ``nn.Linear`` stays in high precision (None: it is converted to FP8)."""
    if fqn == "lm_head" or fqn.endswith(".lm_head") or fqn == "output":
        return "output head"
    if module.in_features % 16 or module.out_features % 16:
        return "dims not divisible by 16"
    pattern = exclude_globs.match(fqn, exclude)
    return f"user exception (--fp8_exclude {pattern})" if pattern else None


class TorchaoFp8(Plain):
    """The runtime side: conversion before sharding, and the fused scale pass after each step (no autocast:
    the converted layers quantize themselves)."""

    def __init__(self, recipe: str, emulated: bool, all_gather: bool, exclude: tuple[str, ...] = (),
                 verify: str = "error", stats_every: int = 0):
        self.recipe, self.emulated, self.all_gather, self.exclude = recipe, emulated, all_gather, exclude
        self.verifier = fp8_verify.Verifier(self.layers, fp8_weights, all_gather, not emulated, verify)
        self.stats = fp8_stats.TorchaoStats(stats_every) if stats_every else None

    def convert(self, model: nn.Module) -> nn.Module:
        ao = torchao_import()
        config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(self.recipe), emulate=self.emulated,
                                     enable_fsdp_float8_all_gather=self.all_gather)
        total = sum(isinstance(m, nn.Linear) for m in model.modules())
        exclude_globs.check_all_match(self.exclude, [n for n, m in model.named_modules() if isinstance(m, nn.Linear)])
        ao.convert_to_float8_training(model, config=config, module_filter_fn=self.convert_filter)
        converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        if self.stats is not None:
            self.stats.attach(model)
        log.info("torchao FP8 (%s%s): converted %d/%d linears", self.recipe, ", emulated" if self.emulated else "",
                 converted, total)
        return model

    def post_step(self, model: nn.Module) -> None:
        """With FP8 all-gather, compute every weight's FP8 scale for the next all-gather in one fused pass
        (instead of one all-reduce per layer during forward)."""
        if self.all_gather:
            torchao_import().precompute_float8_dynamic_scale_for_fsdp(model)
        self.verifier.after_step(model)

    def report(self, writer, step: int) -> None:
        """After each step: the FP8 check's record (once) and, on --fp8_stats steps, the per-layer numerics."""
        self.verifier.report(writer.write)
        if self.stats is not None:
            fp8_stats.report(self.stats, writer, step)

    def convert_filter(self, module: nn.Module, fqn: str) -> bool:
        """torchao's module filter: ``fp8_linear_filter`` minus the --fp8_exclude layers."""
        return fp8_linear_filter(module, fqn) and not exclude_globs.match(fqn, self.exclude)

    def layers(self, model: nn.Module) -> list[fp8_verify.LinearLayer]:
        """Every linear layer: in FP8 (a Float8Linear) or not, and why not."""
        out = []
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                fp8 = type(m).__name__ == "Float8Linear"
                why = None if fp8 else (why_high_precision(m, name, self.exclude) or "not converted")
                out.append(fp8_verify.LinearLayer(name, m.in_features * m.out_features, fp8, why))
        return out


def fp8_weights(model: nn.Module) -> set[str]:
    """Names of the weights FSDP2 should all-gather in FP8 (those of the Float8Linear layers)."""
    return {f"{name}.weight" for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}


TORCHAO = TorchaoBackend()
