"""GPU-only scale options (`pytest -m gpu tests/gpu`), skipped without CUDA: CPU offload, FP8 optimizer
states, torchao FP8 all-gather across ranks. Each compares against the plain run's losses.

Tolerances: CPU offload moves the same FP32 shards to host memory and the optimizer step runs there:
losses within 1e-3 relative. FP8 AdamW states and FP8 all-gather change numerics: within 2 % after 20
steps of the tiny model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]
BASE = ["--model", "tiny", "--device", "cuda", "--max_steps", "20", "--logging_freq", "1", "--seed", "4"]


def losses(tmp_path: Path, name: str, *args: str, nproc: int = 1) -> list[float]:
    run_dir = tmp_path / name
    nproc = min(nproc, torch.cuda.device_count())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "llama_fp8", "train", *BASE, "--run_dir", str(run_dir), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["type"] == "train"]


def test_cpu_offload_matches_plain(tmp_path):
    assert losses(tmp_path, "off", "--cpu_offload", "1") == pytest.approx(losses(tmp_path, "plain"), rel=1e-3)


def test_fp8_optimizer_states_track_adamw(tmp_path):
    fp8 = losses(tmp_path, "fp8opt", "--optimizer", "adamw_fp8")
    assert fp8[-1] == pytest.approx(losses(tmp_path, "plain")[-1], rel=0.02)


def test_torchao_fp8_all_gather_across_ranks(tmp_path):
    ag = losses(tmp_path, "ag", "--fp8", "1", "--fp8_all_gather", "1", nproc=2)
    assert ag[-1] == pytest.approx(losses(tmp_path, "f8", "--fp8", "1", nproc=2)[-1], rel=0.02)
