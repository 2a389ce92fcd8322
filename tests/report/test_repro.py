"""The Reproduce block and `compare --repro`: values recorded by the runs come back; the script re-runs."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

from helpers import REPO
from llama_fp8.report import compare as C
from llama_fp8.telemetry import repro


def write_run(run_dir: Path, precision: str, *, job: str, commit: str = "abc123", dirty: bool = False,
              argv: list[str] | None = None) -> None:
    run_dir.mkdir(parents=True)
    meta = {"type": "meta", "precision": precision, "world_size": 2,
            "environment": {"image": "/fsx/llama-fp8.sqsh", "image_digest": "f00d", "torch": "2.13.0",
                            "cuda": "13.0", "transformer_engine": "2.9", "nodes": "p5-[1-2]"},
            "repro": {"git_commit": commit, "git_dirty": dirty, "slurm_job_id": job, "slurm_nodelist": "p5-[1-2]",
                      "argv": argv if argv is not None else ["train", "--model", "tiny", "--fp8",
                                                             str(int(precision == "fp8")), "--run_dir", str(run_dir)]}}
    recs = [{"type": "train", "step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "samples_per_sec": 10.0 + s % 3}
            for s in range(1, 21)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [meta, *recs]))


def test_reproduce_block_lists_what_each_run_recorded(tmp_path):
    write_run(tmp_path / "ab" / "bf16", "bf16", job="101")
    write_run(tmp_path / "ab" / "fp8", "fp8", job="102", dirty=True)
    assert C.main([str(tmp_path / "ab" / "bf16"), str(tmp_path / "ab" / "fp8"), "--out", str(tmp_path / "o")]) == 0
    report = (tmp_path / "o" / "report.md").read_text()
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    rep = summary["repro"]
    assert rep["git_commit"] == "abc123" and rep["git_dirty"] is True and rep["ab_command"] is None
    assert [r["slurm_job_id"] for r in rep["runs"]] == ["101", "102"]
    assert "git commit `abc123` **with uncommitted changes**" in report
    assert "| bf16 | 101 | p5-[1-2] | /fsx/llama-fp8.sqsh (f00d) | torch 2.13.0, cuda 13.0, transformer_engine 2.9 |" in report
    assert "`torchrun --standalone --nproc_per_node=2 -m llama_fp8 train --model tiny --fp8 1" in report


def test_repro_prints_a_script_from_the_runs_commands(tmp_path, capsys):
    write_run(tmp_path / "bf16", "bf16", job="101")
    write_run(tmp_path / "fp8", "fp8", job="102")
    args = [str(tmp_path / "bf16"), str(tmp_path / "fp8")]
    assert C.main([*args, "--repro", "--loss_tolerance", "0.5"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("#!/bin/bash\n") and 'if [ "$(git rev-parse HEAD)" != abc123 ]' in text
    lines = text.splitlines()
    train = [shlex.split(ln) for ln in lines if ln.startswith("torchrun")]
    assert [t[t.index("--fp8") + 1] for t in train] == ["0", "1"] and train[0][-1] == str(tmp_path / "bf16")
    assert shlex.split(lines[-1]) == ["python", "-m", "llama_fp8", "compare", *args, "--loss_tolerance=0.5"]
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0   # valid bash
    assert not (tmp_path / "compare_bf16_vs_fp8").exists()   # --repro writes no report


def test_repro_uses_the_launchers_command_when_the_ab_folder_has_it(tmp_path, capsys):
    ab = tmp_path / "ab"
    for i in (1, 2):
        write_run(ab / f"pair{i}" / "bf16", "bf16", job="7")
        write_run(ab / f"pair{i}" / "fp8", "fp8", job="7")
    (ab / "ab_command.sh").write_text("cd /fsx/repo\nIMAGE=/fsx/x.sqsh /fsx/repo/2.ab_fp8_vs_bf16.sh --repeats 2 "
                                      "--model tiny \n")
    runs = [str(ab / f"pair{i}" / a) for i in (1, 2) for a in ("bf16", "fp8")]
    assert C.main([*runs, "--repro"]) == 0
    text = capsys.readouterr().out
    assert text.rstrip().endswith("/fsx/repo/2.ab_fp8_vs_bf16.sh --repeats 2 --model tiny") and "torchrun" not in text


def test_repro_without_recorded_commands_says_so(tmp_path, capsys):
    write_run(tmp_path / "bf16", "bf16", job="1", argv=[])
    write_run(tmp_path / "fp8", "fp8", job="2")
    assert C.main([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--repro"]) == 2
    assert "no recorded command for run(s) bf16" in capsys.readouterr().err


def test_git_state_from_the_launcher_or_from_git():
    assert repro.git_state({"LLAMA_FP8_GIT_COMMIT": "deadbeef", "LLAMA_FP8_GIT_DIRTY": "1"}) == {
        "git_commit": "deadbeef", "git_dirty": True}
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    state = repro.git_state({})
    assert state["git_commit"] == head and isinstance(state["git_dirty"], bool)
    d = repro.describe(["train", "--seed", "3"], {"SLURM_JOB_ID": "55", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert d["slurm_job_id"] == "55" and d["slurm_nodelist"] == "n[1-2]" and d["argv"] == ["train", "--seed", "3"]
