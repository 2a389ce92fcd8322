"""The order of the runs of a repeated A/B, shared by the Slurm A/B job and the CPU demo.

R pairs run interleaved in one allocation: pair i runs both arms with seed ``s_i = base + i - 1``, and
the order alternates from pair to pair (bf16 fp8, fp8 bf16, bf16 fp8, ...), so slow drift of a shared
node (thermals, a neighbour's job) lands on both arms instead of on whichever ran second.

    python -m llama_fp8.cluster.launch.schedule --repeats R [--order "bf16 fp8"] -- TRAIN_ARGS...
prints one line per run, in run order: ``RUN_SUBDIR FP8 SEED`` (the shell loop reads it); with
``--compare`` instead the run folders for ``llama_fp8 compare``, baseline first in each pair.
One pair keeps the folders ``bf16`` and ``fp8``; R > 1 uses ``pair<i>/bf16`` and ``pair<i>/fp8``.
The base seed is the last ``--seed`` in TRAIN_ARGS, else TrainConfig's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

ARMS = ("bf16", "fp8")
MAX_REPEATS = 100


@dataclass(frozen=True)
class Arm:
    pair: int   # 1-based
    name: str   # bf16 | fp8
    seed: int
    subdir: str

    @property
    def fp8(self) -> int:
        return int(self.name == "fp8")


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


def plan(repeats: int, order: tuple[str, str] = ARMS, seed: int = 0) -> list[Arm]:
    """Every run of the A/B in run order (module docstring)."""
    if not 1 <= repeats <= MAX_REPEATS:
        raise ValueError(f"--repeats {repeats}: must be between 1 and {MAX_REPEATS}")
    if sorted(order) != sorted(ARMS):
        raise ValueError(f"order {' '.join(order)!r}: name the arms fp8 and bf16 once each, e.g. 'bf16 fp8'")
    runs = []
    for i in range(1, repeats + 1):
        first_second = order if i % 2 else order[::-1]
        for name in first_second:
            runs.append(Arm(i, name, seed + i - 1, name if repeats == 1 else f"pair{i}/{name}"))
    return runs


def compare_dirs(runs: list[Arm]) -> list[str]:
    """Run folders for ``compare``: per pair the baseline (bf16) then the candidate (fp8)."""
    by = {(r.pair, r.name): r.subdir for r in runs}
    return [by[(p, name)] for p in sorted({r.pair for r in runs}) for name in ARMS]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m llama_fp8.cluster.launch.schedule", allow_abbrev=False)
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs (default 1)")
    p.add_argument("--order", default="bf16 fp8", help="the arms of pair 1, in run order")
    p.add_argument("--compare", action="store_true", help="print the run folders for compare instead")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the training flags (for --seed)")
    args = p.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        runs = plan(args.repeats, tuple(args.order.split()), base_seed(train_args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.compare:
        print(" ".join(compare_dirs(runs)))
    else:
        for r in runs:
            print(r.subdir, r.fp8, r.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
