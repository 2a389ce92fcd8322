"""torchao FP8 (``Float8Linear``): works on any model built of ``nn.Linear`` layers, emulated on CPU; and
torchao's block formats, MXFP8 (emulated without SM100) and NVFP4 (SM100 only), as module swaps
(``precision/torchao_mx.py``).

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
from llama_fp8.precision import Plain, fp8_stats, torchao_mx
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
                          choice.stats_every, seed=cfg.seed)


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
    if emulated and not recipe.emulated_on_cpu:
        where = "this CPU" if capability is None else f"this GPU (compute capability {capability[0]}.{capability[1]})"
        raise ConfigError(f"--fp8_recipe {recipe.name} (torchao) needs an NVIDIA GPU of compute capability >= "
                          f"{recipe.min_capability[0]}.{recipe.min_capability[1]} (Blackwell: B200, GB200, B300): "
                          f"torchao runs it with Triton kernels only and has no emulation, so {where} cannot run "
                          f"it; here --fp8_recipe mxfp8 shows a block format's numerics (emulated), and --model_impl te "
                          f"--fp8_recipe {recipe.name} runs it on a Blackwell node too")
    if not emulated:
        check_gpu_software(recipe)
    if emulated:
        where = "CPU" if capability is None else f"{torch.cuda.get_device_name(device)} (SM {capability[0]}.{capability[1]})"
        log.warning("FP8 is EMULATED on %s (no FP8 tensor cores): loss is representative, speed numbers are "
                    "meaningless", where)
    return emulated


def check_gpu_software(recipe: Recipe) -> None:
    """On the GPU that runs it natively: the PyTorch and the Triton a recipe's kernels need."""
    if recipe.min_torch != "0" and recipe_table.older(torch.__version__, recipe.min_torch):
        raise ConfigError(f"--fp8_recipe {recipe.name} (torchao) needs torch >= {recipe.min_torch} (installed: "
                          f"{torch.__version__})")
    if recipe.format == "nvfp4":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError(f"--fp8_recipe {recipe.name} (torchao) runs Triton kernels: install triton (it comes "
                              "with CUDA builds of torch)")


def check_flags(cfg, recipe: Recipe) -> None:
    """What torchao's FP8 refuses in the flags alone (no library, no GPU needed)."""
    if cfg.fp8_all_gather and not recipe.fp8_all_gather_since:
        able = ", ".join(r.name for r in RECIPES if r.fp8_all_gather_since)
        why = ("torchao's FSDP2 hooks for its block formats all-gather the high-precision weight"
               if recipe.format != "fp8" else "one scale per weight can be computed before the all-gather")
        raise ConfigError(f"--fp8_all_gather 1 works with the {able} recipe only ({why}); got --fp8_recipe "
                          f"{recipe.name}; use --fp8_all_gather 0")
    if cfg.tp_size > 1 and not recipe.tensor_parallel:
        able = ", ".join(r.name for r in RECIPES if r.tensor_parallel)
        raise ConfigError(f"--fp8_recipe {recipe.name} with --tp_size {cfg.tp_size}: torchao's FP8 tensor-parallel "
                          f"layers scale whole tensors; use --fp8_recipe {able}")


def fp8_linear_filter(module: nn.Module, fqn: str) -> bool:
    """torchao conversion filter: Linear layers only, not the output head, dims divisible by 16
    (FP8 GEMMs need 16-aligned dims)."""
    if not isinstance(module, nn.Linear):
        return False
    if is_output_head(fqn):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def why_high_precision(module: nn.Module, fqn: str, exclude: tuple[str, ...] = (), multiple: int = 16) -> str | None:
    """Why an ``nn.Linear`` stays in high precision (None: it is converted to FP8)."""
    if is_output_head(fqn):
        return "output head"
    if module.in_features % multiple or module.out_features % multiple:
        return f"dims not divisible by {multiple}"
    pattern = exclude_globs.match(fqn, exclude)
    return f"user exception (--fp8_exclude {pattern})" if pattern else None


class TorchaoFp8(Plain):
    """The runtime side: conversion before sharding, and the fused scale pass after each step (no autocast:
    the converted layers quantize themselves)."""

    def __init__(self, recipe: str, emulated: bool, all_gather: bool, exclude: tuple[str, ...] = (),
                 verify: str = "error", stats_every: int = 0, seed: int = 0):
        self.recipe, self.emulated, self.all_gather, self.exclude = recipe, emulated, all_gather, exclude
        self.row, self.seed = recipe_table.get(recipe, BACKEND), seed
        self.verifier = fp8_verify.Verifier(self.layers, fp8_weights, all_gather, not emulated, verify)
        self.stats = fp8_stats.TorchaoStats(stats_every) if stats_every else None

    def convert(self, model: nn.Module) -> nn.Module:
        total = sum(isinstance(m, nn.Linear) for m in model.modules())
        exclude_globs.check_all_match(self.exclude, [n for n, m in model.named_modules() if isinstance(m, nn.Linear)])
        if self.row.format == "fp8":
            ao = torchao_import()
            config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(self.recipe), emulate=self.emulated,
                                         enable_fsdp_float8_all_gather=self.all_gather)
            ao.convert_to_float8_training(model, config=config, module_filter_fn=self.convert_filter)
        else:
            torchao_import()
            torchao_mx.convert(model, self.row.format, self.emulated, self.block_filter)
        converted = sum(is_low_precision(m) for m in model.modules())
        if self.stats is not None:
            self.stats.attach(model)
        log.info("torchao %s (%s%s): converted %d/%d linears", self.row.format.upper(), self.recipe,
                 ", emulated" if self.emulated else "", converted, total)
        return model

    def prepare(self, model: nn.Module) -> None:
        """NVFP4: each layer's Hadamard signs and rounding seed, drawn from --seed (torchao_mx.prepare)."""
        if self.row.format == "nvfp4":
            torchao_mx.prepare(model, self.seed)

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

    def block_filter(self, module: nn.Module, fqn: str) -> bool:
        """The block formats' filter: every linear but the output head and the --fp8_exclude layers; a layer whose
        shape breaks the format's rule is refused (the plan's check, precision/dims.py, covers the model's own
        decoder linears; this names any other)."""
        if is_output_head(fqn) or exclude_globs.match(fqn, self.exclude):
            return False
        n = self.row.dims.features
        if module.in_features % n or module.out_features % n:
            raise ConfigError(f"--fp8_recipe {self.recipe} (torchao): {fqn} is {module.in_features} -> "
                              f"{module.out_features}; {self.row.format} needs in and out features divisible by {n} "
                              f"({self.row.dims.why}); keep it in BF16 with --fp8_exclude {fqn}")
        return True

    def layers(self, model: nn.Module) -> list[fp8_verify.LinearLayer]:
        """Every linear layer: in low precision (torchao's layer) or not, and why not."""
        out = []
        multiple = self.row.dims.features if self.row.dims else 16
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                low = is_low_precision(m)
                why = None if low else (why_high_precision(m, name, self.exclude, multiple) or "not converted")
                out.append(fp8_verify.LinearLayer(name, m.in_features * m.out_features, low, why))
        return out


def is_output_head(fqn: str) -> bool:
    return fqn == "lm_head" or fqn.endswith(".lm_head") or fqn == "output"


def is_low_precision(module: nn.Module) -> bool:
    """A torchao Float8Linear, MXFP8Linear or NVFP4Linear."""
    return type(module).__name__ == "Float8Linear" or torchao_mx.is_block_linear(module)


def fp8_weights(model: nn.Module) -> set[str]:
    """Names of the weights FSDP2 should all-gather in FP8 (those of the Float8Linear layers; torchao's block
    formats all-gather their weights in BF16)."""
    return {f"{name}.weight" for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}


TORCHAO = TorchaoBackend()
