"""GPU tests of the block formats and of one job comparing every precision (`pytest -m gpu tests`), skipped
without CUDA. On Hopper: the new refusals through the real command, the eager warning, the multi-arm job on FP8
arms with the A/B preset (compile, FP8 all-gather). On Blackwell (compute capability 10.x) only: torchao's native
MXFP8 and its NVFP4, Transformer Engine's MXFP8 (auto) and NVFP4, each training the real command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import REPO, cli_env, read_metrics

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
BLACKWELL = pytest.mark.skipif(torch.cuda.is_available() and not (10, 0) <= CAPABILITY < (12, 0), reason=(
    f"needs compute capability 10.0 to below 12.0 (Blackwell: B200, GB200) for native MXFP8/NVFP4; this GPU is "
    f"{CAPABILITY[0]}.{CAPABILITY[1]}"))
BELOW_BLACKWELL = pytest.mark.skipif(CAPABILITY >= (10, 0), reason="tests the refusals of a GPU without MXFP8/NVFP4")
NVFP4_DIMS = ("--hidden_width", "256", "--num_heads", "2", "--num_key_value_heads", "1", "--intermediate_size", "512",
              "--max_context_width", "128")


def train(run_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llama_fp8", "train", "--model", "tiny", "--device", "cuda", "--dataset", "synthetic",
           "--max_steps", "20", "--logging_freq", "2", "--seed", "0", "--run_dir", str(run_dir), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=1800)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stderr[-4000:]}"
    return proc


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["type"] == "train"]


def resolved(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())["resolved"]["precision"]


@BELOW_BLACKWELL
@pytest.mark.parametrize("args, message", [
    (("--model_impl", "hf", "--fp8_recipe", "nvfp4"), "--fp8_recipe nvfp4 (torchao) needs an NVIDIA GPU of compute "
                                                       "capability >= 10.0"),
    (("--model_impl", "te", "--fp8_recipe", "nvfp4"), "nvfp4 needs compute capability >= 10.0 (Blackwell"),
    (("--model_impl", "te", "--fp8_recipe", "mxfp8"), "mxfp8 needs compute capability >= 10.0"),
])
def test_formats_this_gpu_cannot_run_are_refused_before_building(tmp_path, args, message):
    if "te" in args and not _te():
        pytest.skip("Transformer Engine is not installed here")
    proc = train(tmp_path / "run", "--fp8", "1", *args, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def test_a_torchao_arm_running_eager_is_warned_at_start_and_recorded(tmp_path):
    proc = train(tmp_path / "eager", "--model_impl", "hf", "--fp8", "1", "--max_steps", "4")
    assert "runs eager (--compile 0)" in proc.stderr and "pytorch/ao#2262" in proc.stderr
    assert any("pytorch/ao#2262" in n for n in resolved(tmp_path / "eager")["notes"])


def test_the_multi_arm_job_runs_fp8_arms_with_the_ab_preset_and_reports_them(tmp_path):
    """The schedule with --preset ab on this GPU: every arm compiled alike (torchao), FP8 all-gather where the recipe
    allows it; then one report of every arm."""
    base = ["--model", "tiny", "--model_impl", "hf", "--seed", "3"]
    sched = subprocess.run([sys.executable, "-m", "llama_fp8.cluster.launch.schedule", "--repeats", "1", "--arms",
                            "bf16,tensorwise,rowwise", "--preset", "ab", "--", *base], capture_output=True, text=True,
                           env=cli_env(), cwd=REPO, check=True)
    lines = [line.split() for line in sched.stdout.splitlines()]
    assert all("--compile=1" in line for line in lines) and "A/B preset: --compile=1 for every arm" in sched.stderr
    assert "--fp8_all_gather=1" in next(line for line in lines if line[0].endswith("tensorwise"))
    for subdir, fp8, seed, *flags in lines:
        train(tmp_path / subdir, *flags, f"--fp8={fp8}", f"--seed={seed}", "--model_impl", "hf")
    dirs = [str(tmp_path / "pair1" / a) for a in ("bf16", "tensorwise", "rowwise")]
    proc = subprocess.run([sys.executable, "-m", "llama_fp8", "compare", *dirs, "--arms", "3", "--out",
                           str(tmp_path / "report")], capture_output=True, text=True, env=cli_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    rows = {r["arm"]: r for r in summary["arms"]}
    assert rows["tensorwise"]["compile"] is True and rows["tensorwise"]["all_gather"] is True
    assert rows["rowwise"]["all_gather"] is False and rows["bf16"]["compile"] is True
    assert rows["tensorwise"]["mfu_key"] == "mfu_vs_fp8_peak" and rows["bf16"]["mfu_key"] == "mfu_vs_bf16_peak"


@BLACKWELL
@pytest.mark.parametrize("recipe, dims", [("mxfp8", ()), ("nvfp4", NVFP4_DIMS)])
def test_torchao_block_formats_train_natively_on_blackwell_close_to_bf16(tmp_path, recipe, dims):
    train(tmp_path / "bf16", "--model_impl", "hf", *dims)
    train(tmp_path / recipe, "--model_impl", "hf", "--fp8", "1", "--fp8_recipe", recipe, "--compile", "1", *dims)
    prec = resolved(tmp_path / recipe)
    assert (prec["recipe"], prec["format"], prec["emulated"]) == (recipe, recipe, False)
    a, b = losses(tmp_path / "bf16"), losses(tmp_path / recipe)
    assert b[-1] < b[0] and abs(b[-1] - a[-1]) / a[-1] < 0.05
    check = next(r for r in read_metrics(tmp_path / recipe) if r["type"] == "fp8_check")
    assert check["problems"] == [] and check["fp8_linears"] == check["linears"] - 1  # all but the head


@BLACKWELL
def test_te_picks_mxfp8_on_blackwell_and_trains_nvfp4(tmp_path):
    if not _te():
        pytest.skip("Transformer Engine is not installed here")
    train(tmp_path / "auto", "--model_impl", "te", "--fp8", "1")
    prec = resolved(tmp_path / "auto")
    assert prec["recipe"] == "mxfp8" and "compute capability 10." in prec["reason"]
    train(tmp_path / "nvfp4", "--model_impl", "te", "--fp8", "1", "--fp8_recipe", "nvfp4", "--fp8_exclude",
          "last:25%")
    assert resolved(tmp_path / "nvfp4")["bf16_tail"].startswith("decoder blocks 3 (1 of 4)")
    assert losses(tmp_path / "nvfp4")[-1] < losses(tmp_path / "nvfp4")[0]
    meta = next(r for r in read_metrics(tmp_path / "nvfp4") if r["type"] == "meta")
    train_rec = next(r for r in read_metrics(tmp_path / "nvfp4") if r["type"] == "train")
    assert meta["precision_format"] == "nvfp4" and "mfu_vs_fp4_peak" in train_rec
