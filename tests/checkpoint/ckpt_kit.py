"""Small runs and paths shared by the checkpoint tests."""

from __future__ import annotations

from llama_fp8 import config as C
from llama_fp8 import train as T

BASE = ["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "32",
        "--train_batch_size", "2", "--logging_freq", "1", "--lr_decay_iters", "8", "--seed", "3"]


def run(run_dir, *args: str) -> int:
    return T.run(C.parse_args([*BASE, "--run_dir", str(run_dir), *args]))


def ck(b, step: int):
    return b / "checkpoints" / f"step_{step}"
