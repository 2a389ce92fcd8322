"""The A/B job's settings for every arm (``schedule --preset ab``), decided on a node of the job, where the model
implementation and the GPU are those the arms will run on:

- ``--compile=1`` for every arm of a model implementation alike (its BF16 baseline too) when any of its arms' recipes
  needs torch.compile for its speed-up (torchao's: eager, its layers are slower than BF16, ``precision.EAGER_NOTE``),
  unless the training flags name ``--compile``; the arms of another implementation (the shoot-out's TE arms, whose
  delayed scaling does not compile) are left as they are;
- ``--fp8_all_gather=1`` for each FP8 arm whose recipe, installed library and flags allow FP8 all-gather (the
  same checks training makes), unless the training flags name ``--fp8_all_gather``.

What it decides and why goes to stderr (the job's log); each run's config.yaml records the flags as asked.
"""

from __future__ import annotations

import sys

import torch


def _named(flag: str, train_args: list[str]) -> bool:
    return any(a == flag or a.startswith(f"{flag}=") for a in train_args)


def _own(value) -> tuple[bool, list[str]]:
    """An arm as given: None (the BF16 baseline), its flags besides --fp8=1 (an FP8 arm) or (fp8, its flags)."""
    if value is None:
        return False, []
    if isinstance(value, tuple):
        return bool(value[0]), list(value[1])
    return True, list(value)


def arm_flags(arms: dict, train_args: list[str], device: torch.device | None = None) -> dict[str, list[str]]:
    """{arm: the preset's extra training flags} (module docstring) for ``arms`` ({name: the arm's own flags besides
    --fp8=1, None for the BF16 baseline, or (runs FP8, its own flags)}); ValueError for training flags that do not
    parse."""
    from llama_fp8 import config, models, precision
    from llama_fp8.errors import ConfigError

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    capability = precision.capability_of(device)
    chosen, impl_of = {}, {}
    try:
        for name, value in arms.items():
            fp8, own = _own(value)
            cfg = config.parse_args([*train_args, f"--fp8={int(fp8)}", *own])
            impl_of[name] = impl = models.resolve(cfg.model_impl, device)
            if fp8:
                backend, recipe, _ = precision.choose(cfg, impl, models.implementations(), capability)
                chosen[name] = (cfg, impl, backend, recipe)
    except ConfigError as e:
        raise ValueError(f"the training flags: {e}") from None
    out: dict[str, list[str]] = {name: [] for name in arms}
    compiled = set() if _named("--compile", train_args) else _compile_groups(chosen, impl_of, out)
    for name, (cfg, impl, backend, recipe) in chosen.items():
        if _named("--fp8_all_gather", train_args):
            break
        why = _all_gather_refusal(cfg, impl, backend, recipe, impl.name in compiled)
        if why is None:
            out[name].append("--fp8_all_gather=1")
            say(f"arm {name}: --fp8_all_gather=1 ({backend.name} {recipe.name} all-gathers its weights in FP8)")
        else:
            say(f"arm {name}: FP8 all-gather off: {why}")
    return out


def _compile_groups(chosen: dict, impl_of: dict, out: dict[str, list[str]]) -> set[str]:
    """Add --compile=1 to every arm of each implementation one of whose recipes needs it; returns those
    implementations' names."""
    groups = {}
    for _, impl, backend, recipe in chosen.values():
        if recipe.needs_compile:
            groups.setdefault(impl.name, set()).add(f"{backend.name} {recipe.name}")
    for impl_name, needing in groups.items():
        members = [n for n, i in impl_of.items() if i.name == impl_name]
        for name in members:
            out[name].append("--compile=1")
        where = "every arm" if len(members) == len(impl_of) else f"every arm on --model_impl {impl_name}"
        say(f"--compile=1 for {where}: {', '.join(sorted(needing))} need torch.compile for their speed-up (eager, "
            f"torchao's low-precision layers are slower than BF16: pytorch/ao#2262); the BF16 baseline compiles alike")
    return set(groups)


def _all_gather_refusal(cfg, impl, backend, recipe, compiled: bool) -> str | None:
    """Why ``--fp8_all_gather 1`` would be refused for this arm (None: it is allowed), by training's own checks."""
    import dataclasses

    from llama_fp8 import models, precision
    from llama_fp8.errors import ConfigError

    if not recipe.fp8_all_gather_since:
        return f"{backend.name} {recipe.name} all-gathers in BF16"
    trial = dataclasses.replace(cfg, fp8_all_gather=True, compile=cfg.compile or compiled)
    try:
        precision.check_flags(trial, impl, models.implementations())
        precision.check_library(backend, recipe, True)
    except ConfigError as e:
        return str(e)
    return None


def say(line: str) -> None:
    print(f"A/B preset: {line}", file=sys.stderr)
