"""The cluster recipe on a real Slurm (two slurmd on this host, CPU): the preflight all-reduce over both nodes,
the same-allocation A/B, and the requeue of a submitit job whose tasks have no Slurm tools (as in a container).
The image path of the batch scripts (named container, mounts, environment) runs under real Pyxis + Enroot in
test_container_jobs.py: the srun stand-in that only recorded --container-* options is gone."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from slurm_helpers import (
    REPO,
    SBATCH,
    SMALL,
    assert_completed,
    job_info,
    pause_env,
    read_jsonl,
    release_requeued,
    sbatch,
    signal_while_paused,
    wait_job,
)

pytestmark = pytest.mark.slurm


def test_preflight_all_reduce_on_two_nodes(job_env, tmp_path):
    """Preflight as 2 tasks on each of 2 nodes: each node's checks, then a gloo all-reduce over all 4 ranks with
    its bus bandwidth; the report file feeds the run's metrics.jsonl meta record."""
    (tmp_path / "logs").mkdir()
    run = tmp_path / "run"
    # A torchrun rank's variables in the submitting shell (sbatch exports them) must not reach the steps: with
    # them every preflight task believed it was rank 0 of 1 and the all-reduce never ran.
    env = dict(job_env, NPROC_PER_NODE="2", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    job = sbatch(["--nodes=2", SBATCH, *SMALL, "--max_steps", "2", "--fp8=0", "--run_dir", str(run)], env, tmp_path)
    info = wait_job(job, env, timeout=300)
    log = tmp_path / "logs" / f"llama-fp8_{job}.out"
    assert_completed(info, log)
    text = log.read_text()
    assert "preflight on n1:" in text and "preflight on n2:" in text  # each node's own checks
    assert "[  OK] network: gloo over TCP (CPU run)" in text
    # the GB200 / FSx checks on nodes with neither: each node says so, and the job step adds no NVLink line
    assert text.count("[  OK] nvlink_domain: NVLink fabric not read: no nvidia-smi on PATH") == 2
    assert text.count("[  OK] lustre: checkpoint_dir not on Lustre (nothing to check)") == 2
    assert text.count("nvlink_domain") == 2
    assert "all_reduce: 4 MiB x 10 over 4 ranks on 2 node(s): busbw" in text
    assert "preflight of job step: 2 node(s), 4 task(s): passed" in text
    report = json.loads((tmp_path / "logs" / f"llama-fp8-preflight_{job}.json").read_text())
    assert report["network"]["nodes"] == 2 and report["network"]["busbw_gbps"] > 0 and report["network"]["values_ok"]
    env_meta = read_jsonl(run / "metrics.jsonl")[0]["environment"]
    # the attempt's training nodes as `llama-fp8 launch` names them, in node-rank order (the rendezvous's)
    assert sorted(env_meta["nodes"].split(",")) == ["n1", "n2"] and env_meta["nccl_network"] == "gloo (TCP)"
    assert env_meta["preflight_busbw_gbps"] == report["network"]["busbw_gbps"]


def test_same_allocation_ab(job_env, tmp_path):
    """2.ab_fp8_vs_bf16.sh (default AB_MODE=same): ONE job, both arms back to back on the same two nodes, then
    the report in that allocation; SBATCH_ARGS (partition) reach it; the report says the hardware is the same."""
    ab = tmp_path / "ab"
    env = dict(job_env, SBATCH_ARGS="--nodes=2 --partition=alt", NPROC_PER_NODE="1", AB_DIR=str(ab))
    # --compile 0 named: the preset leaves compile as named (test_schedule_arms.py checks that it adds --compile=1
    # otherwise, and these flags' way to the runs is the same). A CPU compile of both arms is C++ built by g++ on a
    # machine whose compile cache is cold (each CI run; a fresh clone's venv path changes the kernels' keys): about
    # 60 s more for this test and 30 CPU s, measured on a fresh clone.
    proc = subprocess.run([str(REPO / "2.ab_fp8_vs_bf16.sh"), *SMALL, "--max_steps", "3", "--compile", "0"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    job = next(ln.split()[2] for ln in proc.stdout.splitlines() if ln.startswith("ab job:"))
    info = wait_job(job, env, timeout=420)
    log = tmp_path / "logs" / f"llama-fp8-ab_{job}.out"
    assert_completed(info, log)
    assert info["Partition"] == "alt" and info["NodeList"] == "n[1-2]"
    text = log.read_text()
    arms = re.findall(r"^== run (\w+) \((.*?)--fp8=(\d) --seed=(\d+)\) on n1,n2$", text, re.M)  # its training nodes
    assert [(name, fp8) for name, _, fp8, _ in arms] == [("bf16", "0"), ("fp8", "1")], arms  # one pair, in order
    assert arms[0][3] == arms[1][3]  # both arms of a pair train with the same seed
    # the A/B preset's flags reach each arm's run: the FP8 arm (torchao tensorwise) all-gathers its weights in FP8
    assert [flags.split() for _, flags, _, _ in arms] == [[], ["--fp8_all_gather=1"]]
    assert text.count("preflight of job step: 2 node(s)") == 1  # one preflight for both arms
    for name, fp8 in (("fp8", True), ("bf16", False)):
        assert yaml.safe_load((ab / name / "config.yaml").read_text())["asked"]["fp8"] is fp8
        assert (ab / name / ".ab_done").exists()
    summary = json.loads((ab / "report" / "summary.json").read_text())
    assert summary["environment"]["same_hardware"] is True
    # each arm's nodes in node-rank order (the rendezvous's), compared as the machines they are (report/hardware.py)
    assert summary["environment"]["a"]["nodes"] == summary["environment"]["b"]["nodes"] == "n1,n2"
    assert "Hardware: same hardware" in (ab / "report" / "report.md").read_text()


@pytest.mark.slow
def test_two_jobs_ab_passes_sbatch_args_to_the_report_job(job_env, tmp_path):
    """AB_MODE=two-jobs: three jobs, all in the SBATCH_ARGS partition (the report job too); the report records
    each arm's nodes and says "not the same hardware" exactly when they differ."""
    ab = tmp_path / "ab"
    env = dict(job_env, AB_MODE="two-jobs", SBATCH_ARGS="--nodes=1 --partition=alt", NPROC_PER_NODE="1",
               SKIP_PREFLIGHT="1", AB_DIR=str(ab))
    proc = subprocess.run([str(REPO / "2.ab_fp8_vs_bf16.sh"), *SMALL, "--max_steps", "2"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    jobs = {line.split(":")[0]: line.split()[2] for line in proc.stdout.splitlines() if " job:" in line}
    assert set(jobs) == {"fp8 job", "bf16 job", "report job"}, proc.stdout
    info = wait_job(jobs["report job"], env, timeout=300)
    assert_completed(info, tmp_path / "logs" / f"llama-fp8-report_{jobs['report job']}.out")
    infos = {name: job_info(job, env) for name, job in jobs.items()}
    assert {i["Partition"] for i in infos.values()} == {"alt"}
    summary = json.loads((ab / "report" / "summary.json").read_text())
    same_nodes = infos["fp8 job"]["NodeList"] == infos["bf16 job"]["NodeList"]
    assert summary["environment"]["same_hardware"] is same_nodes
    report = (ab / "report" / "report.md").read_text()
    assert ("not the same hardware" in report) is (not same_nodes)


def no_slurm_python(tmp_path: Path) -> Path:
    """A `python` for the tasks whose PATH holds no Slurm tool (a stand-in for a container without them)."""
    empty = tmp_path / "task-bin"
    empty.mkdir()
    wrapper = tmp_path / "python-no-slurm"
    wrapper.write_text(f"#!/bin/sh\nPATH={empty}\nexport PATH\n"
                       f"echo \"task PATH=$PATH scontrol=$(command -v scontrol || echo none)\" >&2\n"
                       f"exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def test_submitit_requeue_without_slurm_tools_in_the_task(job_env, tmp_path):
    """submit: SIGUSR1 -> training saves and the task exits 85 -> the batch script's trap (on the host) requeues
    -> the next attempt resumes from the checkpoint and finishes every step; `submit --wait` follows it all.
    The tasks run with a PATH without scontrol, like a Pyxis container."""
    run, folder, faults = tmp_path / "run", tmp_path / "sub", tmp_path / "faults"
    env = dict(job_env, **pause_env(faults))
    cmd = [sys.executable, "-m", "llama_fp8", "submit", "--nodes", "2", "--tasks_per_node", "1", "--time", "10",
           "--folder", str(folder), "--python", str(no_slurm_python(tmp_path)), "--wait", "--",
           *SMALL, "--max_steps", "40", "--fp8=0", "--run_dir", str(run)]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any(ln.startswith("submitted job") for ln in lines) and time.monotonic() < deadline:
            time.sleep(0.5)
        job = next(ln for ln in lines if ln.startswith("submitted job")).split()[2].rstrip(":")
        log = folder / job / f"{job}_0_log.out"
        signal_while_paused(job, job_env, faults, 2, log)
        release_requeued(job, job_env)
        assert proc.wait(timeout=300) == 0, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", job], env=job_env, check=False)
    reader.join(timeout=10)
    out = "".join(lines)
    assert f"job {job} finished with exit status 0" in out
    text = log.read_text()
    assert "scontrol=none" in text  # the tasks really had no scontrol
    assert f"llama-fp8: checkpoint saved (exit 85): requeueing job {job}" in text
    assert job_info(job, job_env)["Restarts"] == "1"
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records if r["type"] == "train"][-1] == 40
    starts = [r["start_step"] for r in records if r["type"] == "meta"]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] == 3, starts  # the second attempt resumed
    assert not (folder / job / "llama-fp8-requeue").exists()  # the trap consumed the marker
