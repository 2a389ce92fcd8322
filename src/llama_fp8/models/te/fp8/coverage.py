"""Transformer Engine's side of --fp8_exclude and of the "is FP8 really on?" coverage count.

TE's GEMM modules (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``) run in FP8 under the autocast unless
an enclosing module's forward was wrapped by ``precision/exclude.disable_fp8_in`` (a nested autocast with
enabled=False); plain ``torch.nn.Linear`` layers (the output head) never run in TE's FP8.

Whether a TE module did run in FP8 is its own state: every forward sets ``module.fp8`` from the autocast it runs
under and ``forwarded_at_least_once`` (``prepare_forward`` -> ``init_fp8_metadata``,
transformer_engine/pytorch/module/base.py, TE 2.20), so the count reads that after a step rather than trusting
names or the exclusion list.
"""

from __future__ import annotations

from torch import nn

from llama_fp8.precision import exclude
from llama_fp8.precision.verify import LinearLayer

TE_GEMMS = ("Linear", "LayerNormLinear", "LayerNormMLP")
RAN_WITHOUT_FP8 = "ran without FP8 (TE's own state after the step)"


def is_te_gemm(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformer_engine") and type(module).__name__ in TE_GEMMS


def gemm_weights(module: nn.Module) -> list[tuple[str, int]]:
    """(name, numel) of the 2-D weights a TE GEMM module multiplies by (fc1 and fc2 for LayerNormMLP)."""
    return [(n, p.numel()) for n, p in module.named_parameters(recurse=False) if n.endswith("weight") and p.dim() == 2]


def _disabled(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if getattr(m.forward, "fp8_disabled", False)}


def exclusion_names(model: nn.Module) -> list[str]:
    """Module names a --fp8_exclude glob may match: TE GEMM modules and every module that contains one."""
    names: set[str] = set()
    for name, m in model.named_modules():
        if is_te_gemm(m):
            parts = name.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(names)


def apply_exclusions(model: nn.Module, patterns: tuple[str, ...], fp8_off) -> list[str]:
    exclude.check_all_match(patterns, exclusion_names(model))
    return exclude.disable_fp8_in(model, patterns, fp8_off)


def layers(model: nn.Module, patterns: tuple[str, ...] = ()) -> list[LinearLayer]:
    """Every GEMM layer of the TE model: in FP8 or not, and why not. A TE module that has not run a forward yet
    counts as what it is meant to be."""
    off = _disabled(model)
    out = []
    for name, m in model.named_modules():
        if is_te_gemm(m):
            hit = next((d for d in off if name == d or name.startswith(d + ".")), None)
            why = f"user exception (--fp8_exclude {exclude.match(hit, patterns) or hit})" if hit else None
            if hit is None and getattr(m, "forwarded_at_least_once", False) and not getattr(m, "fp8", True):
                why = RAN_WITHOUT_FP8
            out.append(LinearLayer(name, sum(n for _, n in gemm_weights(m)), why is None, why))
        elif isinstance(m, nn.Linear):
            out.append(LinearLayer(name, m.in_features * m.out_features, False, "output head (not a TE module)"))
    return out


def fp8_weights(model: nn.Module) -> set[str]:
    """Names of the weights FSDP2 should all-gather in FP8 (TE FP8 parameters of layers running in FP8)."""
    fp8 = {layer.name for layer in layers(model) if layer.fp8}
    return {f"{name}.{w}" for name, m in model.named_modules() if name in fp8 for w, _ in gemm_weights(m)}
