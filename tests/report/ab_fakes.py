"""The A/B batch job (scripts/slurm/ab_job.sbatch) run outside Slurm: its job library and srun faked, sbatch faked
for the launcher (2.ab_fp8_vs_bf16.sh). The fakes record what they were asked to run under AB_DIR."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from helpers import REPO

FAKE_JOB_LIB = """EXIT_REQUEUE=85
lf_die() { echo "error: $*" >&2; exit 1; }
lf_setup() { PY=("$FAKE_PY"); CONTAINER_ARGS=(); lf_setup_nodes; }  # the real one sets the nodes too
lf_preflight() { :; }
lf_estimate() { :; }  # tests/estimate/test_prejob.py
lf_setup_nodes() {  # the training nodes: the job's, or n1,n3 once a spare took n2's place (AB_DIR/swapped)
    LF_TRAINERS=$SLURM_JOB_NODELIST LF_SPARES=""
    if [[ -f "$AB_DIR/swapped" ]]; then LF_TRAINERS=n1,n3; fi
}
lf_run_training() {  # like the real one: a job step (srun), which reads its stdin
    srun --nodes=1 bash -c 'echo "$*" >>"$AB_DIR/train.calls"; d="${*: -1}"; mkdir -p "${d#--run_dir=}"' _ "$@"
    if [[ -n "${FAKE_SWAP_IN:-}" && "$*" == *"--run_dir=$AB_DIR/$FAKE_SWAP_IN" ]]; then touch "$AB_DIR/swapped"; fi
}
"""
FAKE_SRUN = """#!/bin/bash
cat >/dev/null   # srun forwards stdin to its tasks: take all of it, as a task reading stdin would
while [[ "$1" == --* ]]; do shift; done
if [[ "$*" == *"llama_fp8 compare"* ]]; then echo "$*" >>"$AB_DIR/compare.calls"; exit 0; fi
if [[ "$*" == *"llama_fp8 publish"* ]]; then echo "$*" >>"$AB_DIR/publish.calls"; exit "${FAKE_PUBLISH_RC:-0}"; fi
exec "$@"
"""


def fake_ab_job(tmp_path: Path, srun: str = FAKE_SRUN) -> tuple[Path, dict[str, str]]:
    """A copy of the real ab_job.sbatch beside the fake job library, and the environment that puts the fake ``srun``
    first on PATH (add AB_DIR, SLURM_JOB_ID, SLURM_JOB_NODELIST and the AB_* knobs of the case)."""
    repo = tmp_path / "repo"
    (repo / "scripts" / "slurm").mkdir(parents=True)
    (repo / "scripts" / "slurm" / "ab_job.sbatch").write_text((REPO / "scripts/slurm/ab_job.sbatch").read_text())
    (repo / "scripts" / "slurm" / "job_lib.sh").write_text(FAKE_JOB_LIB)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(srun)
    (bin_dir / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "REPO_DIR": str(repo), "FAKE_PY": sys.executable,
           "PYTHONPATH": str(REPO / "src")}
    return repo / "scripts" / "slurm" / "ab_job.sbatch", env


def fake_sbatch(tmp_path: Path, knob: str) -> dict[str, str]:
    """An sbatch that appends ``KNOB=<its value> <its arguments>`` to tmp_path/sbatch.calls and prints job id 101."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "{knob}=${knob} $*" >>{tmp_path}/sbatch.calls\necho 101\n')
    (bin_dir / "sbatch").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "AB_DIR": str(tmp_path / "ab")}
