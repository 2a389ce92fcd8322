"""benchmarks/bench_goodput.py runs end to end on the shared local cluster (a short job, one kill) and prints its
table and one JSON line; its numbers are measurements, not checks (benchmarks/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from slurm_helpers import REPO, make_job_env

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_bench_goodput_prints_table_and_ratio(cluster):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_goodput.py"), "--cluster_dir",
                        cluster.root, "--steps", "60", "--checkpoint_freq", "4", "--every", "2", "--max_kills", "1"],
                       capture_output=True, text=True, timeout=600, env=make_job_env(cluster), cwd=REPO)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    rec = json.loads(line)
    assert rec["bench"] == "goodput" and rec["kills"] == 1 and rec["ratio"] > 0
    assert len(rec["restart_s"]) == 1 and rec["restart_s"][0] > 0
    assert len(rec["steps_lost"]) == 1 and 0 <= rec["steps_lost"][0] <= 4  # at most one interval's steps
    assert "faulted" in r.stdout and "faultfree" in r.stdout
