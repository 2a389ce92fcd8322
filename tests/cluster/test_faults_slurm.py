"""A rank that stops making progress, on a real Slurm (two slurmd on this host, CPU): the job fails once
--process_group_timeout has passed, saying so, and after `scontrol requeue` it resumes from the last
complete checkpoint and finishes. The row of the fault matrix (tests/reliability/matrix.py)."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_helpers import REPO, SMALL, batch_lines, release_requeued, sbatch, wait_job

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
import matrix  # noqa: E402 - the fault matrix's row recorder lives with the matrix

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
TIMEOUT = 20


def ended_at(info: dict[str, str]) -> float:
    return datetime.datetime.strptime(info["EndTime"], "%Y-%m-%dT%H:%M:%S").timestamp()


def test_rank_hangs_in_a_collective_on_slurm(job_env, tmp_path):
    (tmp_path / "logs").mkdir()
    run, faults = tmp_path / "run", tmp_path / "faults"
    faults.mkdir()
    # `once`: the fault fires in the first attempt only (its marker file survives the requeue).
    env = dict(job_env, NPROC_PER_NODE="2", SKIP_PREFLIGHT="1", LLAMA_FP8_FAULT="hang@step:step=5:rank=1:once",
               LLAMA_FP8_FAULT_DIR=str(faults))
    job = sbatch(["--nodes=1", str(REPO / "1.train_llama.sbatch"), *SMALL, "--max_steps", "8", "--checkpoint_freq",
                  "2", "--process_group_timeout", str(TIMEOUT), "--run_dir", str(run)], env, tmp_path)
    log = tmp_path / "logs" / f"llama-fp8_{job}.out"
    info = wait_job(job, env, timeout=300)
    text = log.read_text()
    assert info["JobState"] == "FAILED", f"{info}\n{text[-3000:]}"
    hung_at = (faults / "fired.step.rank1").stat().st_mtime
    # Rank 0's next collective gives up after the timeout, naming it; torchrun then stops the hung rank
    # (SIGTERM, then SIGKILL after its 30 s grace period: a rank stuck for real ignores SIGTERM too).
    assert f"Timed out waiting {TIMEOUT * 1000}ms" in text, text[-3000:]
    assert f"a collective did not complete within --process_group_timeout={TIMEOUT} s" in text, text[-3000:]
    failed_after = ended_at(info) - hung_at
    assert TIMEOUT - 2 <= failed_after <= TIMEOUT + 60, failed_after
    assert batch_lines(log)[-1] == 4 and (run / "checkpoints" / "step_4" / "COMPLETE").is_file()

    subprocess.run(["scontrol", "requeue", job], env=env, check=True)
    release_requeued(job, env)
    info = wait_job(job, env, timeout=300)
    text = log.read_text()
    assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), f"{info}\n{text[-3000:]}"
    assert "resumed from" in text and "Training finished: 8 steps" in text
    assert batch_lines(log) == [1, 2, 3, 4, 5, 6, 7, 8], batch_lines(log)  # the requeue went on after step_4
    matrix.record("test_rank_hangs_in_a_collective_on_slurm",
                  f"job FAILED {failed_after:.0f} s after the hang; rank 0: \"a collective did not complete within "
                  f"--process_group_timeout={TIMEOUT} s ... (Timed out waiting {TIMEOUT * 1000}ms ...)\"; step_4 intact; after scontrol requeue: resumed from "
                  f"step_4, steps 5-8 trained, COMPLETED", 0)
