"""The recipe shoot-out: ``--arms shootout``, one A/B job that runs every FP8 recipe this node can run against BF16,
interleaved on the same nodes, so that the report ranks them at equal quality (iso-loss speed-up, report/shootout.py).

Decided on a node of the job (``schedule --arms shootout`` runs there), from what training itself would accept on it
(``precision.resolve`` for each arm's flags, with the training flags given):

- ``bf16``: the baseline, on the model implementation the training flags pick (``--model_impl``, default auto);
- ``tensorwise`` (with FP8 all-gather where the A/B preset allows it) and ``rowwise``: torchao's recipes;
- ``current`` and ``delayed``: Transformer Engine's per-tensor current and delayed scaling;
- ``mxfp8``: where the GPU has MXFP8 (compute capability 10.x; emulated on a CPU, torchao's);
- ``bf16_<impl>``: BF16 on every other model implementation a recipe needs (torchao's recipes run on one, TE's on
  another), so that each candidate also has a BF16 run of its own implementation (report/arms.py compares it with
  that one, and ranks every arm against ``bf16``).

Each recipe arm runs on the implementation whose FP8 backend has the recipe (the baseline's when it has it), named
with ``--model_impl``. An arm this node cannot run (no GPU for TE, a GPU without MXFP8, a library not installed) is
left out with the reason on stderr.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the arms are decided: a plain A/B's schedule starts without it
    import torch

NAME = "shootout"
RECIPES = ("tensorwise", "rowwise", "current", "delayed", "mxfp8")


@dataclass(frozen=True)
class ArmSpec:
    name: str
    fp8: bool
    flags: tuple[str, ...] = ()


def _implementation_for(recipe: str, base):
    """The model implementation whose FP8 backends have ``recipe``: the baseline's when it does."""
    from llama_fp8 import models
    from llama_fp8.precision import recipes

    def has(impl) -> bool:
        return any(recipe in {r.name for r in recipes.rows_of(b.name)} for b in impl.fp8_backends())
    if has(base):
        return base
    return next((i for i in models.implementations() if has(i)), None)


def _refusal(train_args: list[str], flags: list[str], impl, device: torch.device) -> str | None:
    """Why training would refuse this arm on this node (None: it runs)."""
    from llama_fp8 import config, precision
    from llama_fp8.errors import ConfigError

    try:
        cfg = config.parse_args([*train_args, *flags])
        impl.check(cfg, device)
        precision.resolve(cfg, impl, device)
    except ConfigError as e:
        return str(e)
    return None


def arms(train_args: list[str], device: torch.device | None = None) -> tuple[ArmSpec, ...]:
    """The shoot-out's arms on ``device`` (module docstring); ValueError for training flags that do not parse."""
    import torch

    from llama_fp8 import config, models
    from llama_fp8.errors import ConfigError

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        base = models.resolve(config.parse_args([*train_args, "--fp8=0"]).model_impl, device)
    except ConfigError as e:
        raise ValueError(f"the training flags: {e}") from None
    candidates, others = [], {}
    for recipe in RECIPES:
        impl = _implementation_for(recipe, base)
        if impl is None:
            say(f"{recipe} left out: no model implementation has an FP8 backend with it")
            continue
        flags = ["--fp8=1", f"--fp8_recipe={recipe}", f"--model_impl={impl.name}"]
        why = _refusal(train_args, flags, impl, device)
        if why:
            say(f"{recipe} left out: {why}")
            continue
        candidates.append(ArmSpec(recipe, True, tuple(flags[1:])))
        if impl is not base:
            others[impl.name] = ArmSpec(f"bf16_{impl.name}", False, (f"--model_impl={impl.name}",))
    if not candidates:
        raise ValueError(f"--arms {NAME}: no FP8 recipe runs on this node ({device}); the reasons are above")
    out = (ArmSpec("bf16", False), *others.values(), *candidates)
    say(f"arms {', '.join(a.name for a in out)} (bf16 on --model_impl {base.name}"
        + (f"; {', '.join(others)} for the recipes of that implementation" if others else "") + ")")
    return out


def say(line: str) -> None:
    print(f"A/B shoot-out: {line}", file=sys.stderr)
