"""The arms of an A/B read one tokenized corpus: text named by the training flags is tokenized once, before the
arms, and every arm gets the corpus, so both read the same tokens and neither tokenizes (docs/data.md).

    python -m llama_fp8.cluster.launch.ab_data --out AB_DIR/corpus [--workers N] -- TRAIN_ARGS...

prints the arms' training arguments, NUL-separated (``mapfile -d '' -t ARGS < <(...)`` in bash): TRAIN_ARGS, then
``--dataset AB_DIR/corpus`` and the text flags set back to their defaults (they belong to the tokenizing; train refuses
them with a corpus). Synthetic data, a --dataset that is already a corpus and --data_blend are passed through
unchanged. Rerun (a requeued A/B job), it finds the corpus made and only checks it. Exit 2 with the reason on a bad
flag or source. (AB_MODE=two-jobs runs each arm as a job of its own: there, tokenize first and give the arms the
corpus.)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from llama_fp8 import config
from llama_fp8.data import tokenize
from llama_fp8.data.corpus import is_corpus
from llama_fp8.data.loader import TEXT_FLAGS
from llama_fp8.errors import EXIT_BAD_CONFIG, ConfigError


def _flag_value(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


def arm_args(train_args: list[str], out: Path, workers: int) -> list[str]:
    """The training arguments every arm runs with (module docstring); tokenizes into ``out`` if needed."""
    cfg = config.parse_args(train_args)
    if cfg.data_blend or cfg.dataset == "synthetic" or is_corpus(cfg.dataset):
        return list(train_args)
    if not cfg.tokenizer:
        raise ConfigError(f"--dataset={cfg.dataset!r} needs --tokenizer (a local folder or hub id)")
    cmd = ["--dataset", cfg.dataset, "--tokenizer", cfg.tokenizer, "--out", str(out), "--workers", str(workers)]
    for name, _ in TEXT_FLAGS:
        value = getattr(cfg, name)
        if value is not None:
            cmd += [f"--{name}", str(int(value)) if isinstance(value, bool) else str(value)]
    if tokenize.main(cmd) != 0:
        raise ConfigError(f"tokenizing --dataset={cfg.dataset!r} into {out} failed (the reason is above)")
    resets = [x for name, default in TEXT_FLAGS if getattr(cfg, name) != default
              for x in (f"--{name}", _flag_value(default))]
    return [*train_args, "--dataset", str(out), *resets]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m llama_fp8.cluster.launch.ab_data", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the corpus folder (on the shared file system)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    args = p.parse_args(ours)
    try:
        out = arm_args(train_args, Path(args.out), args.workers)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    sys.stdout.write("".join(f"{a}\0" for a in out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
