"""GPU self-tests of torchao's FP8 path (`pytest -m gpu tests`), skipped without CUDA: save at step 10 and resume
to 20 under each torchao recipe, against the uninterrupted run (the TE recipes: tests/models/te/test_te_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def losses(run_dir: Path, *args: str) -> dict[int, float]:
    """Steps 11-20 of `llama-fp8 train` on the HF model with torchao FP8 (resuming when run_dir has a checkpoint)."""
    cmd = [sys.executable, "-m", "llama_fp8", "train", "--model", "tiny", "--model_impl", "hf", "--device", "cuda",
           "--fp8", "1", "--fp8_backend", "torchao", "--dataset", "synthetic", "--seed", "0", "--logging_freq", "1",
           "--lr_decay_iters", "20", "--checkpoint_freq", "10", "--run_dir", str(run_dir), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=1800)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["type"] == "train" and r["step"] > 10}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_fp8_resume_matches_the_uninterrupted_run(tmp_path, recipe):
    """As the TE test: the resumed losses match an uninterrupted 20-step run within the run-to-run noise, measured
    by running the uninterrupted run twice (at least 1e-3 relative). torchao's scales come from the current step,
    so nothing but weights and optimizer state has to survive the checkpoint."""
    flags = ("--fp8_recipe", recipe)
    a = losses(tmp_path / "a", *flags, "--max_steps", "20")
    b = losses(tmp_path / "b", *flags, "--max_steps", "20")
    noise = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    losses(tmp_path / "r", *flags, "--max_steps", "10")
    resumed = losses(tmp_path / "r", *flags, "--max_steps", "20")
    assert sorted(resumed) == list(range(11, 21))
    worst = max(abs(resumed[s] - a[s]) / abs(a[s]) for s in a)
    assert worst <= max(2 * noise, 1e-3), (worst, noise)


@pytest.mark.parametrize("compile_", ["0", "1"])
def test_the_fp8_check_passes_a_torchao_run_and_records_its_gemm_kernels(tmp_path, compile_):
    """The "is FP8 on?" check on a real torchao run, eager and compiled (where Inductor names the casts after their
    ops and cuBLASLt names FP8 GEMMs nvjet_qq... with CUDA 13): it passes, records every GEMM kernel with calls and
    time, and finds FP8 evidence (aten::_scaled_mm calls, or a GEMM kernel named as FP8). What this run records is
    what confirms the kernel names the check knows."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "llama_fp8", "train", "--model", "tiny", "--model_impl", "hf", "--device", "cuda",
           "--fp8", "1", "--fp8_backend", "torchao", "--fp8_recipe", "tensorwise", "--compile", compile_,
           "--dataset", "synthetic", "--max_steps", "3", "--run_dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (check,) = [r for r in records if r["type"] == "fp8_check"]
    assert check["problems"] == [], json.dumps(check)
    assert check["gemm_kernels"] and all(g["calls"] > 0 for g in check["gemm_kernels"]), json.dumps(check)
    assert check["scaled_mm_calls"] > 0 or check["fp8_gemm_kernels"] > 0, json.dumps(check["gemm_kernels"])
    assert check["notes"] == [], check["notes"]
