"""The order of the runs of a repeated A/B, shared by the Slurm A/B job and the CPU demo.

R repeats run interleaved in one allocation: repeat i runs every arm with seed ``s_i = base + i - 1``, and the
order alternates from repeat to repeat (bf16 fp8, fp8 bf16, bf16 fp8, ...; with more arms the whole order is
reversed), so slow drift of a shared node (thermals, a neighbour's job) lands on every arm instead of on whichever
ran last. The arms: ``bf16`` (the baseline, always there), ``fp8`` (``--fp8 1``, the recipe the training flags or
``auto`` pick), or a ``--fp8_recipe`` name (``mxfp8``, ``nvfp4``, ``tensorwise``, ...: ``--fp8 1`` with that recipe,
on whichever FP8 backend the model implementation has). Each candidate is compared with the BF16 run of its repeat.

    python -m llama_fp8.cluster.launch.schedule --repeats R [--arms bf16,fp8,mxfp8] [--order "bf16 fp8"]
        [--preset ab] [--extra_steps PCT] -- TRAIN_ARGS...
prints one line per run, in run order: ``RUN_SUBDIR FP8 SEED [FLAGS...]`` (the shell loop reads it; FLAGS: the
arm's own training flags, and with ``--preset ab`` the A/B settings of ``ab_preset.py``); with ``--compare`` instead
the run folders for ``llama_fp8 compare``, per repeat the baseline first, then the candidates in arm order.
Two arms over one repeat keep the folders ``bf16`` and ``fp8``; R > 1 uses ``pair<i>/<arm>``.
The base seed is the last ``--seed`` in TRAIN_ARGS, else TrainConfig's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

from llama_fp8.cluster.launch import shootout

ARMS = ("bf16", "fp8")
BASELINE = "bf16"
MAX_REPEATS = 100
MAX_ARMS = 8


@dataclass(frozen=True)
class Arm:
    pair: int   # 1-based repeat
    name: str   # bf16 | fp8 | a --fp8_recipe name | a preset's arm
    seed: int
    subdir: str
    spec: shootout.ArmSpec | None = None  # a preset's arm: whether it runs FP8, and its own flags

    @property
    def fp8(self) -> int:
        return int(self.spec.fp8) if self.spec else int(self.name != BASELINE)

    def flags(self) -> list[str]:
        """The arm's own training flags besides --fp8 (a recipe arm names its recipe)."""
        if self.spec:
            return list(self.spec.flags)
        return [] if self.name in ARMS else [f"--fp8_recipe={self.name}"]


def arm_names() -> tuple[str, ...]:
    from llama_fp8.precision import recipes

    return (*ARMS, *recipes.names())


def parse_arms(text: str) -> tuple[str, ...]:
    """``bf16,fp8,mxfp8`` (commas or spaces) -> the arms, checked: known names, each once, bf16 among them."""
    arms = tuple(a for a in text.replace(",", " ").split() if a)
    known = arm_names()
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise ValueError(f"arms {', '.join(unknown)}: not an arm; arms are bf16, fp8 or a --fp8_recipe name "
                         f"({', '.join(known)})")
    if len(set(arms)) != len(arms) or BASELINE not in arms or not 2 <= len(arms) <= MAX_ARMS:
        raise ValueError(f"arms {' '.join(arms)!r}: name {BASELINE} (the baseline) and 1 to {MAX_ARMS - 1} other "
                         f"arms, each once, e.g. 'bf16,fp8,mxfp8'")
    return arms


def plan(repeats: int, order: tuple[str, ...] = ARMS, seed: int = 0,
         specs: dict[str, shootout.ArmSpec] | None = None) -> list[Arm]:
    """Every run of the A/B in run order (module docstring); ``order``: the arms of repeat 1, in run order;
    ``specs``: a preset's arms (their FP8 switch and own flags), by name."""
    if not 1 <= repeats <= MAX_REPEATS:
        raise ValueError(f"--repeats {repeats}: must be between 1 and {MAX_REPEATS}")
    if specs:
        if sorted(order) != sorted(specs):
            raise ValueError(f"order {' '.join(order)!r}: name the preset's arms {', '.join(specs)} once each")
    else:
        if len(order) == 2 and (len(set(order)) < 2 or BASELINE not in order):
            raise ValueError(f"order {' '.join(order)!r}: name the arms fp8 and bf16 once each, e.g. 'bf16 fp8'")
        order = parse_arms(" ".join(order))
    flat = repeats == 1 and sorted(order) == sorted(ARMS)  # the old layout: bf16/ and fp8/
    runs = []
    for i in range(1, repeats + 1):
        for name in (order if i % 2 else order[::-1]):
            runs.append(Arm(i, name, seed + i - 1, name if flat else f"pair{i}/{name}", (specs or {}).get(name)))
    return runs


def compare_dirs(runs: list[Arm]) -> list[str]:
    """Run folders for ``compare``: per repeat the baseline (bf16), then the candidates in arm order."""
    by = {(r.pair, r.name): r.subdir for r in runs}
    candidates = list(dict.fromkeys(r.name for r in runs if r.name != BASELINE))
    return [by[(p, name)] for p in sorted({r.pair for r in runs}) for name in (BASELINE, *candidates)]


def steps_flags(pct: int, train_args: list[str]) -> list[str]:
    """An FP8 arm's longer run (``--extra_steps``): ``--max_steps`` PCT %% more, the LR decaying over the baseline's
    steps (then at --min_lr); none for 0."""
    if not 0 <= pct <= 100:
        raise ValueError(f"--extra_steps {pct}: a percentage from 0 to 100")
    if pct == 0:
        return []
    from llama_fp8 import config
    from llama_fp8.errors import ConfigError

    try:
        cfg = config.parse_args(train_args)
    except ConfigError as e:
        raise ValueError(f"the training flags: {e}") from None
    return [f"--max_steps={-(-cfg.max_steps * (100 + pct) // 100)}", f"--lr_decay_iters={cfg.lr_decay_iters}"]


def base_seed(train_args: list[str]) -> int:
    """The last ``--seed N`` / ``--seed=N`` of the train flags, else the training default."""
    seed = None
    for i, arg in enumerate(train_args):
        if arg == "--seed" and i + 1 < len(train_args):
            seed = train_args[i + 1]
        elif arg.startswith("--seed="):
            seed = arg.split("=", 1)[1]
    if seed is None:
        from llama_fp8.config import TrainConfig
        return next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "seed")
    if not seed.isdigit():
        raise ValueError(f"--seed {seed!r}: must be an integer >= 0")
    return int(seed)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m llama_fp8.cluster.launch.schedule", allow_abbrev=False)
    p.add_argument("--repeats", type=int, default=1, help="repeats of every arm (default 1)")
    p.add_argument("--arms", default=None, help="the arms, comma-separated (default bf16,fp8), or the preset "
                   f"{shootout.NAME} (every FP8 recipe this node runs, against BF16: cluster/launch/shootout.py)")
    p.add_argument("--order", default=None, help="the arms of repeat 1, in run order (default: --arms' order)")
    p.add_argument("--preset", choices=("ab",), default=None, help="ab: add the A/B job's settings to each arm "
                   "(compile every arm alike where a backend needs it, FP8 all-gather where a recipe allows it)")
    p.add_argument("--extra_steps", type=int, default=0, metavar="PCT",
                   help="FP8 arms run PCT %% more steps than --max_steps, on the baseline's LR schedule (--lr_decay_iters "
                        "kept at the baseline's), so that one whose loss tracks BF16's can reach BF16's final loss: the "
                        "iso-loss speed-up (default 0: every arm the same steps)")
    p.add_argument("--compare", action="store_true", help="print the run folders for compare instead")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the training flags (for --seed)")
    args = p.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        specs = {a.name: a for a in shootout.arms(train_args)} if args.arms == shootout.NAME else None
        arms = tuple(specs) if specs else parse_arms(args.arms) if args.arms else ARMS
        asked = None if specs and args.order == shootout.NAME else args.order  # the job's default order: AB_ARMS
        order = tuple(asked.split()) if asked else arms
        if asked and args.arms and sorted(order) != sorted(arms):
            raise ValueError(f"--order {args.order!r}: name the arms of --arms {args.arms} once each")
        runs = plan(args.repeats, order, base_seed(train_args), specs)
        extra = {r.name: steps_flags(args.extra_steps, train_args) if r.fp8 else [] for r in runs}
        if args.preset and not args.compare:
            from llama_fp8.cluster.launch import ab_preset

            own = {r.name: (bool(r.fp8), r.flags()) for r in runs}
            extra = {k: [*v, *extra[k]] for k, v in ab_preset.arm_flags(own, train_args).items()}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.compare:
        print(" ".join(compare_dirs(runs)))
    else:
        for r in runs:
            print(" ".join([r.subdir, str(r.fp8), str(r.seed), *r.flags(), *extra.get(r.name, [])]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
