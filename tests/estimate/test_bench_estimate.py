"""Smoke test of benchmarks/bench_estimate.py on the tiny preset: it runs, prints its table and one JSON line
with a finite ratio. What an estimate costs is measured by the benchmark (benchmarks/README.md), never here."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from helpers import REPO, cli_env

pytestmark = pytest.mark.slow


def test_bench_estimate_prints_its_table_and_one_json_line():
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_estimate.py"), "--presets", "tiny", "--gpus",
                        "1,8"], capture_output=True, text=True, timeout=600, env=cli_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    rec = json.loads(line)
    assert rec["bench"] == "estimate" and math.isfinite(rec["ratio"]) and rec["ratio"] > 0
    assert [(x["preset"], x["gpus"], x["verdict"]) for x in rec["results"]] == [("tiny", 1, "fits"), ("tiny", 8, "fits")]
    assert all(x["cpu_s"] > 0 and x["peak_rss_mib"] > 0 for x in rec["results"])
    assert "CPU x baseline" in r.stdout and "baseline" in r.stdout


def test_bench_estimate_refuses_a_world_size_of_partial_nodes():
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_estimate.py"), "--gpus", "12"],
                       capture_output=True, text=True, timeout=120, env=cli_env(), cwd=REPO)
    assert r.returncode == 2 and "--gpus" in r.stderr
