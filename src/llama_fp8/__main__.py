"""`python -m llama_fp8 {train,tokenize,estimate,compare,submit,convert,preflight,fp8-bisect,publish} ...` (also the
`llama-fp8` script)."""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

from llama_fp8 import collector

COMMANDS = {
    "train": "train a model (torchrun, srun or a single process)",
    "tokenize": "text into a tokenized corpus, once, for every training run to read (locally or a Slurm array)",
    "estimate": "will a training run fit? per-GPU memory and per-step communication, without a GPU",
    "compare": "A/B report of two runs: table + plots",
    "launch": "torchrun that keeps the workers' exit code (used by 1.train_llama.sbatch)",
    "submit": "submit a training job to Slurm through submitit",
    "convert": "export a checkpoint to a Hugging Face folder",
    "preflight": "check a node: GPUs, FP8 support, TE, NCCL, EFA, file systems",
    "fp8-bisect": "find the decoder layers to keep in BF16 for FP8 to match BF16's loss",
    "publish": "an A/B report as an MLflow run, each arm's run a child of it",
}
MODULES = {"train": "llama_fp8.train.cli", "tokenize": "llama_fp8.data.tokenize", "estimate": "llama_fp8.estimate.cli", "compare": "llama_fp8.report.compare",
           "launch": "llama_fp8.cluster.launch.torchrun", "submit": "llama_fp8.cluster.launch.submit", "convert": "llama_fp8.convert",
           "preflight": "llama_fp8.cluster.nodes.preflight", "fp8-bisect": "llama_fp8.fp8_bisect",
           "publish": "llama_fp8.publish"}


def _usage() -> str:
    lines = ["usage: llama-fp8 {" + ",".join(COMMANDS) + "} [flags]", ""]
    lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
    lines += ["", "`llama-fp8 COMMAND --help` lists the flags of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"llama-fp8: unknown command {cmd!r}\n{_usage()}", file=sys.stderr)
        return 2
    with collector.paused(freeze=True):  # the command's imports, torch's among them (src/llama_fp8/collector.py)
        module = importlib.import_module(MODULES[cmd])
    return int(module.main(rest) or 0)


def program() -> NoReturn:
    """``python -m llama_fp8`` and the ``llama-fp8`` script: the command's imports frozen once made, and the process
    leaving without the collections of Python's shutdown (src/llama_fp8/collector.py)."""
    collector.as_program()
    collector.leave(main())


if __name__ == "__main__":
    program()
