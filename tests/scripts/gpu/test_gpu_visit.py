"""scripts/gpu/visit.sh, the one command a GPU node runs per visit step, end to end on CPU: the install from a (fake) kit,
then a slice of verify.py through the real trainer, with everything that must come back written to $OUT."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kit_fakes as fakes
import pytest
import runs

VISIT = Path(__file__).resolve().parents[3] / "scripts" / "gpu" / "visit.sh"


@pytest.mark.slow
def test_visit_installs_then_runs_a_slice_and_leaves_the_results_in_out(tmp_path):
    # torchao comes from this venv (as a node may have it), TE from the fake kit
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=fakes.torch_version(), skip=("torchao",))
    guard, net_log = fakes.net_guard(tmp_path)
    out = tmp_path / "out"
    env = {**fakes.merge_env(guard), "PYTHON": sys.executable, "WHEELS": str(kit), "SITE": str(tmp_path / "site"),
           "OUT": str(out), "VISIT_SECONDS": "1500"}  # a loaded CPU is slow: the budget is tested elsewhere
    argv = ["--device", "cpu", "--models", "tiny", "--only", "train", "--match",
            "train/tiny/synthetic/hf-bf16", "--max-steps", "4", "--warmup-steps", "2", "--logging-freq", "2",
            "--results", str(tmp_path / "results.jsonl"), "--work", str(tmp_path / "work")]
    proc = subprocess.run(["bash", str(VISIT), *argv], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "install.log").read_text()
    assert "TE: transformer_engine.pytorch imports" in log
    assert "TE kernels: no CUDA device: TE's kernels not run" in log  # a GPU node runs one FP8 te.Linear here
    committed = runs.load(VISIT.parents[2] / "docs" / "gpu-results" / "results.jsonl")  # merged in: a visit goes on
    records = [r for r in runs.load(out / "results.jsonl") if r not in committed]  # from them; this command's own
    assert [r["unit"] for r in records] == ["versions", "train/tiny/synthetic/hf-bf16"]
    assert records[0]["versions"]["transformer_engine"] == fakes.TE_VERSION  # verify saw the installed kit
    assert records[1]["status"] == "passed" and (out / "logs.tar.gz").is_file()
    assert "1 of 1 selected units to run" in proc.stdout
    assert not net_log.exists()


def test_visit_refuses_a_kit_that_differs_from_its_manifest(tmp_path):
    import json

    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "torchao-0.18.0-py3-none-any.whl").write_bytes(b"changed")
    (kit / "MANIFEST.json").write_text(json.dumps({"files": {"torchao-0.18.0-py3-none-any.whl": {"sha256": "0" * 64}}}))
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "WHEELS": str(kit), "SITE": str(tmp_path / "site"),
           "OUT": str(out)}
    proc = subprocess.run(["bash", str(VISIT), "--plan", "first"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "sha256 differs: torchao-0.18.0-py3-none-any.whl" in proc.stderr
    assert not (tmp_path / "site").exists() and not (out / "install.log").exists()


def test_visit_refuses_a_budget_too_small_to_measure_anything(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "VISIT_SECONDS": "50"}
    proc = subprocess.run(["bash", str(VISIT), "--plan", "first"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "VISIT_SECONDS '50': expected whole seconds, at least 75" in proc.stderr
