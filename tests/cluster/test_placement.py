"""Placement in one NVLink domain: the batch scripts and ``submit`` pass a segment request (``sbatch --segment``, Slurm's
topology/block: the nodes of a segment share one block, e.g. one GB200 NVL72 rack) through to sbatch, and refuse what
Slurm would. PLUMBING ONLY: ``--segment`` needs Slurm 24.05+ with topology/block configured (docs/gb200.md); this
repository's local Slurm is 22.05, which has neither, so sbatch is a stand-in that records its arguments and no job is
placed. Preflight's warning when a job's nodes span two domains is tests/cluster/test_nvlink.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers import REPO
from llama_fp8.cluster.launch import submit


def run_ab(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """2.ab_fp8_vs_bf16.sh with a stand-in sbatch (one line of arguments per call)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$*" >>{tmp_path}/sbatch.calls\necho 101\n')
    (bin_dir / "sbatch").chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k not in ("SEGMENT", "SBATCH_ARGS", "AB_MODE")}
    full.update(PATH=f"{bin_dir}:{os.environ['PATH']}", AB_DIR=str(tmp_path / "ab"), **env)
    proc = subprocess.run([str(REPO / "2.ab_fp8_vs_bf16.sh"), *args], env=full, cwd=tmp_path, capture_output=True,
                          text=True)
    calls = tmp_path / "sbatch.calls"
    return proc, calls.read_text().splitlines() if calls.exists() else []


def test_segment_reaches_the_same_allocation_job(tmp_path):
    proc, calls = run_ab(tmp_path, "--model", "tiny", SEGMENT="18", SBATCH_ARGS="--nodes=18 --partition=gb200")
    assert proc.returncode == 0, proc.stderr
    (call,) = calls
    assert call.startswith("--parsable --nodes=18 --partition=gb200 --segment=18 ") and "ab_job.sbatch --model tiny" \
        in call
    assert "SEGMENT=18 " in (tmp_path / "ab" / "ab_command.sh").read_text()  # the repro command keeps it


def test_segment_reaches_each_training_job_but_not_the_report(tmp_path):
    proc, calls = run_ab(tmp_path, "--model", "tiny", SEGMENT="16", SBATCH_ARGS="-N 32", AB_MODE="two-jobs")
    assert proc.returncode == 0, proc.stderr
    arms, report = calls[:2], calls[2]
    assert all("--segment=16 " in c and "1.train_llama.sbatch" in c for c in arms)
    assert "--job-name=llama-fp8-report" in report and "--segment" not in report


def test_sbatch_args_pass_any_topology_request_through(tmp_path):
    proc, calls = run_ab(tmp_path, "--model", "tiny", SBATCH_ARGS="--nodes=32 --segment=16 --exclusive=topo")
    assert proc.returncode == 0 and calls[0].startswith("--parsable --nodes=32 --segment=16 --exclusive=topo ")


@pytest.mark.parametrize(("segment", "sbatch_args", "words"), [
    ("x", "", "SEGMENT='x': a number of nodes >= 1"),
    ("0", "", "SEGMENT='0': a number of nodes >= 1"),
    ("16", "--nodes=20", "SEGMENT=16 does not divide the 20 nodes of SBATCH_ARGS"),
    ("16", "--nodes 20", "SEGMENT=16 does not divide the 20 nodes"),
    ("16", "-N20", "SEGMENT=16 does not divide the 20 nodes"),
])
def test_a_segment_slurm_would_refuse_is_refused_before_sbatch(tmp_path, segment, sbatch_args, words):
    proc, calls = run_ab(tmp_path, "--model", "tiny", SEGMENT=segment, SBATCH_ARGS=sbatch_args)
    assert proc.returncode == 2 and words in proc.stderr and calls == []


def test_a_segment_larger_than_the_job_is_allowed():
    """Slurm: "If all nodes fit within a single segment, this option has no effect" (Topology Guide)."""
    args = submit.build_parser().parse_args(["--nodes", "4", "--segment", "18"])
    submit.validate(args)


def test_submit_writes_the_segment_into_the_batch_script(tmp_path):
    import submitit.slurm.slurm as sl

    args = submit.build_parser().parse_args(["--nodes", "36", "--gpus_per_node", "4", "--segment", "18", "--folder",
                                             str(tmp_path)])
    submit.validate(args)
    params = submit.executor_parameters(args)
    assert params["additional_parameters"] == {"signal": "USR1@120", "requeue": True, "segment": 18}
    text = sl._make_sbatch_string(command="true", folder=tmp_path / "%j",
                                  **{k: v for k, v in params.items() if k != "stderr_to_stdout"})
    assert "#SBATCH --segment=18\n" in text and "#SBATCH --nodes=36\n" in text
    assert "segment" not in submit.executor_parameters(submit.build_parser().parse_args([]))["additional_parameters"]


@pytest.mark.parametrize(("argv", "words"), [
    (["--segment", "0"], "--segment must be >= 1"),
    (["--nodes", "20", "--segment", "16"], "--segment 16 does not divide --nodes 20"),
])
def test_submit_refuses_a_segment_slurm_would(argv, words, capsys):
    assert submit.main([*argv, "--", "--model", "tiny"]) == 2
    assert words in capsys.readouterr().err
