"""benchmarks/bench_goodput.py: its arithmetic on records and a log whose answers are known (no cluster), and one
short run on the shared local cluster whose figures must agree with each other and with the job's own log. Its
numbers are measurements, not checks (benchmarks/README.md); what is checked is that they measure what they say."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
from slurm_helpers import REPO, make_job_env


def bench():
    spec = importlib.util.spec_from_file_location("bench_goodput", REPO / "benchmarks" / "bench_goodput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_failures_are_read_from_the_records_and_the_log():
    """A kill at t=100 after step 13 was logged; the next attempt's log says it resumed from step_12, its worker
    process started at 103, its start-up parts took 4 s in all (of startup_s 4.5), its first step ended at 109.
    Steps lost: 13 - 12 = 1; restart 9 s = 3 (kill to the new worker) + 4.5 (start-up) + 1.5 (first steps)."""
    b = bench()
    recs = [{"type": "train", "step": s, "time": 90.0 + s * 0.5} for s in range(1, 14)]
    recs += [{"type": "goodput", "step": 13, "start_step": 0, "process_start": 10.0, "startup_s": 5.0},
             {"type": "meta"}, {"type": "train", "step": 13, "time": 109.0}, {"type": "train", "step": 14, "time": 109.5},
             {"type": "goodput", "step": 20, "start_step": 12, "process_start": 103.0, "startup_s": 4.5,
              "startup_parts": {"imports": 2.5, "model": 1.0, "checkpoint_load": 0.5}}]
    log = "INFO resumed from /r/checkpoints/step_12 (step 12, saved by 2 ranks, now 2)\n"
    (f,) = b.per_failure(recs, [100.0], log)
    assert (f["last_step"], f["resumed_from"], f["steps_lost"], f["restart_s"]) == (13, 12, 1, 9.0)
    assert f["parts"] == {"kill_to_new_worker": 3.0, "imports": 2.5, "model": 1.0, "checkpoint_load": 0.5,
                          "first_steps": 1.5}
    low, high = b.bootstrap_ratio([12.0, 14.0, 13.0], [10.0, 10.0, 10.0])
    assert 1.2 <= low <= 1.3 <= high <= 1.4


def test_a_kill_before_the_first_checkpoint_counts_as_starting_over():
    """Killed after step 3 with checkpoints every 4 (on a slow machine the kill, 2 s after the first step, came that
    early): the next attempt finds no checkpoint and starts over, so its log has no "resumed from" line. Its goodput
    record says where it started (start_step 0): 3 steps lost. Before, the failure was dropped (the kills were matched
    to the log's "resumed from" lines by position), and the bench reported 1 failure for 2 kills."""
    b = bench()
    recs = [{"type": "train", "step": s, "time": 90.0 + s} for s in range(1, 4)]
    recs += [{"type": "meta"}, {"type": "train", "step": 1, "time": 104.0},
             {"type": "goodput", "step": 8, "start_step": 0, "process_start": 97.0, "startup_s": 5.0,
              "startup_parts": {"imports": 3.0, "model": 2.0}}]
    (f,) = b.per_failure(recs, [94.0], "INFO no checkpoint yet: training from the start\n")
    assert (f["last_step"], f["resumed_from"], f["steps_lost"], f["restart_s"]) == (3, 0, 3, 10.0)
    assert f["parts"] == {"kill_to_new_worker": 3.0, "imports": 3.0, "model": 2.0, "first_steps": 2.0}


@pytest.mark.slurm
@pytest.mark.slow
def test_bench_goodput_measures_what_it_says(cluster):
    """One fault-free and one faulted job (their interval over repeats is bootstrap_ratio's, tested above without a
    cluster): the failure's figures must agree with the job's own records and log."""
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_goodput.py"), "--cluster_dir",
                        cluster.root, "--repeats", "1", "--steps", "60", "--checkpoint_freq", "4", "--every", "2",
                        "--max_kills", "1"], capture_output=True, text=True, timeout=1200, env=make_job_env(cluster),
                       cwd=REPO)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    rec = json.loads(line)
    assert rec["bench"] == "goodput" and rec["repeats"] == 1 and rec["kills"] == 1 and len(rec["failures"]) == 1
    assert rec["ratio_ci95"] == [rec["ratio"], rec["ratio"]] and rec["ratio"] > 0  # one job per arm: no interval
    for f in rec["failures"]:
        # observed: the checkpoint resumed from is a saved one, no later than the last step logged before the kill
        assert f["resumed_from"] % 4 == 0 and 0 <= f["steps_lost"] == f["last_step"] - f["resumed_from"] <= 4, f
        # the parts decompose the measured restart (the rest: the moment between the last start-up mark and the loop)
        assert abs(sum(f["parts"].values()) - f["restart_s"]) < 1.0, f
        assert f["parts"]["kill_to_new_worker"] > 0 and f["parts"]["imports"] > 0, f
    assert rec["steps_lost"] == [f["steps_lost"] for f in rec["failures"]]
    assert re.search(r"kill -> next step: median [\d.]+ s", r.stdout) and "where it went" in r.stdout
