"""N-D parallelism on GPUs (`pytest -m gpu tests`), skipped without 2 CUDA devices: context parallelism of
the HF model (torch's ring attention) and of the TE model (TE's own), and FP8 tensor parallelism with FP8
collectives (torchao tensorwise), each against the same run without it.

Tolerances: the runs see the same tokens; CP splits attention into per-chunk partial results combined with
their log-sum-exps (BF16 inputs, FP32 accumulation), TP splits matmuls and reduces partial BF16 outputs: over
10 steps of the tiny model the losses agree within 1e-2 relative (FP8: 2e-2, since the quantization of a
sharded tensor is per shard where the reference quantizes whole tensors)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]
REPO = Path(__file__).resolve().parents[2]
BASE = ["--model", "tiny", "--device", "cuda", "--max_steps", "10", "--logging_freq", "1", "--seed", "5",
        "--max_context_width", "256", "--tie_word_embeddings", "0", "--lr_decay_iters", "10"]


def losses(tmp_path: Path, name: str, *args: str, nproc: int = 2) -> list[float]:
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "llama_fp8", "launch", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "llama_fp8", "train", *BASE, "--run_dir", str(run_dir), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["type"] == "train"]


@pytest.mark.parametrize("impl", ["hf", "te"])
def test_context_parallel_trains_like_one_rank(tmp_path, impl):
    if impl == "te":
        pytest.importorskip("transformer_engine.pytorch")
    cp = losses(tmp_path, "cp", "--model_impl", impl, "--cp_size", "2", "--train_batch_size", "4")
    one = losses(tmp_path, "one", "--model_impl", impl, "--train_batch_size", "4", nproc=1)
    assert cp == pytest.approx(one, rel=1e-2)


def test_fp8_tensor_parallel_with_fp8_collectives_trains_like_fsdp(tmp_path):
    tp = losses(tmp_path, "tp", "--model_impl", "hf", "--fp8", "1", "--tp_size", "2", "--train_batch_size", "4")
    one = losses(tmp_path, "one", "--model_impl", "hf", "--fp8", "1", "--train_batch_size", "4", nproc=1)
    assert tp == pytest.approx(one, rel=2e-2)
