"""The launchers on a real Slurm (two slurmd on this host, CPU mode): sbatch, multi-node, requeue,
submitit, and the A/B script. Each asserts on the job's state, its log and the run dir."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from slurm_helpers import (
    REPO,
    SBATCH,
    SMALL,
    assert_completed,
    batch_lines,
    pause_env,
    read_jsonl,
    release_requeued,
    sbatch,
    signal_while_paused,
    wait_job,
)

pytestmark = pytest.mark.slurm


def test_sbatch_two_tasks_cpu(job_env, tmp_path):
    """sbatch 1.train_llama.sbatch on one node, 2 processes: preflight, torchrun, 6 steps, --fp8=0 honoured."""
    (tmp_path / "logs").mkdir()
    run = tmp_path / "run"
    job = sbatch(["--nodes=1", SBATCH, *SMALL, "--max_steps", "6", "--fp8=0", "--run_dir", str(run)],
                 job_env, tmp_path)
    info = wait_job(job, job_env)
    log = tmp_path / "logs" / f"llama-fp8_{job}.out"  # the script's own #SBATCH --output
    assert_completed(info, log)
    text = log.read_text()
    assert "preflight on" in text and "0 failed" in text
    assert batch_lines(log) == [1, 2, 3, 4, 5, 6]
    assert "Training finished: 6 steps" in text
    records = read_jsonl(run / "metrics.jsonl")
    assert records[0]["type"] == "meta" and records[0]["world_size"] == 2
    assert "fp8" not in records[0]["precision"]
    assert yaml.safe_load((run / "config.yaml").read_text())["asked"]["fp8"] is False  # --fp8=0 reached training
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_sbatch_two_nodes_rendezvous(job_env, tmp_path):
    """Two nodes x 1 process: the c10d rendezvous address comes from `scontrol show node` (NodeAddr)."""
    (tmp_path / "logs").mkdir()
    run = tmp_path / "run"
    # LOGLEVEL=INFO: torch's agent logs the workers' master_addr (rank 0's node: its Slurm NodeAddr, 127.0.0.1 here,
    # not the name socket.getfqdn() gives, which need not resolve on a cluster)
    env = dict(job_env, NPROC_PER_NODE="1", SKIP_PREFLIGHT="1", LOGLEVEL="INFO")
    job = sbatch(["--nodes=2", SBATCH, *SMALL, "--max_steps", "3", "--run_dir", str(run)], env, tmp_path)
    info = wait_job(job, env)
    log = tmp_path / "logs" / f"llama-fp8_{job}.out"
    assert_completed(info, log)
    assert info["NodeList"] == "n[1-2]"
    assert "2 node(s) x 1 process(es)" in log.read_text() and "rendezvous 127.0.0.1:" in log.read_text()
    addrs = set(re.findall(r"master_addr=(\S+)", log.read_text()))
    assert addrs == {"127.0.0.1"}, addrs
    assert batch_lines(log) == [1, 2, 3]
    assert read_jsonl(run / "metrics.jsonl")[0]["world_size"] == 2


def fake_package(root: Path) -> Path:
    """A repo whose `train` asks for a requeue (exit 85) on the first attempt and succeeds after it;
    the launcher modules (__main__, cluster/, config/, faults/, the FP8 recipe table it reads and the progress-file
    format in telemetry/) are the real ones."""
    pkg = root / "src" / "llama_fp8"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name in ("__main__.py", "collector.py", "cluster", "config", "errors.py", "configs", "precision", "telemetry",
                 "faults"):
        (pkg / name).symlink_to(REPO / "src" / "llama_fp8" / name)
    (pkg / "train").mkdir()  # `llama-fp8 train` runs llama_fp8.train.cli
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "cli.py").write_text(
        "import os\n"
        "def main(argv):\n"
        "    restarts = os.environ.get('SLURM_RESTART_COUNT', '0')\n"
        "    print(f'fake train: attempt {int(restarts) + 1}', flush=True)\n"
        "    return 85 if restarts == '0' else 0\n")
    (root / "scripts").symlink_to(REPO / "scripts")  # the batch script's steps (scripts/slurm/job_lib.sh)
    return root


def test_sbatch_requeues_on_exit_85(job_env, tmp_path):
    """Exit code 85 survives torchrun (`llama-fp8 launch`) and makes the script `scontrol requeue` the job."""
    (tmp_path / "logs").mkdir()
    env = dict(job_env, REPO_DIR=str(fake_package(tmp_path / "repo")), NPROC_PER_NODE="1", SKIP_PREFLIGHT="1")
    job = sbatch(["--nodes=1", SBATCH, "--model", "tiny"], env, tmp_path)
    release_requeued(job, env)  # Slurm holds a requeued job 2 min: release it
    info = wait_job(job, env)
    log = tmp_path / "logs" / f"llama-fp8_{job}.out"
    assert_completed(info, log)
    text = log.read_text()  # --open-mode=append keeps both attempts
    assert "fake train: attempt 1" in text and "requeueing job" in text and "fake train: attempt 2" in text
    assert info["Restarts"] == "1"


def test_submitit_two_nodes(job_env, tmp_path, monkeypatch, capsys):
    """`python -m llama_fp8 submit --wait` through submitit's executor (sacct answered by the stand-in)."""
    from llama_fp8.cluster.launch import submit

    for key, value in job_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    rc = submit.main(["--nodes", "2", "--tasks_per_node", "1", "--time", "10", "--folder", str(tmp_path / "sub"),
                      "--wait", "--", *SMALL, "--max_steps", "3", "--fp8=0", "--run_dir", str(run)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "submitted job" in out and "Batch 3 Loss:" in out and "finished with exit status 0" in out
    job = out.split("submitted job ")[1].split(":")[0]
    assert_completed(wait_job(job, job_env, timeout=60), tmp_path / "sub" / job / f"{job}_0_log.out")
    sacct = subprocess.run(["sacct", "-o", "JobID,State,NodeList", "--parsable2", "-j", job],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert sacct[1].split("|")[:2] == [job, "COMPLETED"]
    assert read_jsonl(run / "metrics.jsonl")[0]["world_size"] == 2


def test_preemption_signal_checkpoint_requeue_resume(job_env, tmp_path):
    """What `--signal=USR1@120` does at a time limit: USR1 to the job steps -> training saves a checkpoint
    and exits 85 -> the script requeues the job -> the next attempt resumes and finishes."""
    (tmp_path / "logs").mkdir()
    run = tmp_path / "run"
    env = dict(job_env, NPROC_PER_NODE="2", SKIP_PREFLIGHT="1", **pause_env(tmp_path / "faults"))
    job = sbatch(["--nodes=1", SBATCH, *SMALL, "--max_steps", "60", "--fp8=0", "--run_dir", str(run)], env, tmp_path)
    log = tmp_path / "logs" / f"llama-fp8_{job}.out"
    signal_while_paused(job, env, tmp_path / "faults", 2, log)
    release_requeued(job, env)  # Slurm holds a requeued job 2 min: release it
    info = wait_job(job, env, timeout=240)
    assert_completed(info, log)
    text = log.read_text()
    assert "requeueing job" in text and "Training finished: 60 steps" in text
    assert "resumed from" in text
    assert batch_lines(log) == list(range(1, 61)), "the second attempt must continue after the checkpoint"
    assert "step_3 (step 3, saved by 2 ranks" in text, "the signal's checkpoint: the end of the paused step 3"
