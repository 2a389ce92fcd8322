"""Shared test helpers: run the real CLI (one process or torchrun) and read a run's metrics.

(A module of its own: `from conftest import` is ambiguous with tests/slurm/conftest.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO / "src"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID"):
        env.pop(k, None)
    env.update(extra)
    return env


def run_cli(args: list[str], nproc: int = 1, timeout: float = 300, module: str = "llama_fp8",
            script: str | None = None) -> subprocess.CompletedProcess:
    """`python -m llama_fp8 ARGS` in a fresh process, or under torchrun with nproc ranks."""
    target = [script] if script else ["-m", module]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target]
    else:
        cmd = [sys.executable, *target]
    return subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout, env=cli_env(), cwd=REPO)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["type"] == "train"]


def local_text_flags(tmp_path: Path, monkeypatch) -> list[str]:
    """Train flags for real text built here: a jsonl corpus of stdlib docstrings and a 300-token BPE
    (``demo_data``); hub access off and the datasets cache in tmp_path, also for child processes."""
    import datasets

    from llama_fp8 import demo_data

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    demo = demo_data.prepare_demo_data(tmp_path / "demo", vocab_size=300, max_files=25)
    # --vocab_size 320 covers the 300-token tokenizer (checked at start-up).
    return ["--dataset", str(demo.dataset_dir), "--tokenizer", str(demo.tokenizer_dir), "--vocab_size", "320"]


def tiny_llama_config(**overrides):
    """A tiny HF ``LlamaConfig`` for the TE mapping tests: 4 query heads sharing 2 KV heads (GQA),
    Llama 3 rope base, untied embeddings."""
    from transformers import LlamaConfig

    kwargs = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=500000.0, max_position_embeddings=64, tie_word_embeddings=False)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)
