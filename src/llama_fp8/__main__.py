"""`python -m llama_fp8 {train,tokenize,estimate,compare,submit,convert,preflight,fp8-bisect,publish} ...` (also the
`llama-fp8` script)."""

from __future__ import annotations

import gc
import importlib
import sys
from typing import NoReturn

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
    return int(importlib.import_module(MODULES[cmd]).main(rest) or 0)


def leave(code: int) -> NoReturn:
    """Exit with ``code`` once the command has returned, without the garbage collections of Python's shutdown.

    Python's shutdown collects garbage several times while it clears the modules, each time walking every object
    alive: after imports of torch and transformers and a run, that took 1.5-2 s of CPU per process (a short training
    rank on a CPU spent a fifth of its life leaving; on a restart the launcher waits for it). Frozen, the objects of
    the finished command are left out of those walks. What an exit must still do is done: non-daemon threads are
    joined, atexit handlers (weakref finalizers included) run, the standard streams are flushed, and what is freed
    by reference counting is freed. Only cyclic garbage made before the freeze is not collected; every file and
    store a command writes to is closed by the command itself. Only when this module runs as the program: a test
    calling ``main()`` in its own process keeps its collector."""
    gc.freeze()
    sys.exit(code)


def cli() -> NoReturn:
    """The ``llama-fp8`` console script."""
    leave(main())


if __name__ == "__main__":
    leave(main())
