"""tests/timing.py, the suite's timing recorder: one line per test of the run it was asked for, none for a pytest a
test starts itself (under xdist too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent

INNER = "def test_inner():\n    pass\n"
OUTER = '''import os, subprocess, sys

def test_outer(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "timing", "-p", "no:cacheprovider",
                        "inner_case.py"], cwd=os.path.dirname(__file__), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
'''


@pytest.mark.slow
@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["serial", "xdist"])
def test_a_pytest_started_by_a_test_is_not_recorded(tmp_path, workers):
    """The image's self-test runs pytest inside a container: with the variable inherited it failed on the file of a
    read-only mount (CI), and elsewhere it would add its own tests to the measured run's file."""
    (tmp_path / "inner_case.py").write_text(INNER)
    (tmp_path / "test_outer.py").write_text(OUTER)
    out = tmp_path / "times.jsonl"
    before = time.time()
    env = dict(os.environ, LLAMA_FP8_TEST_TIMES=str(out),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "timing", "-p", "no:cacheprovider", *workers,
                        "test_outer.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [rec["id"] for rec in lines] == ["test_outer.py::test_outer"], lines
    assert lines[0]["outcome"] == "passed" and lines[0]["wall_s"] > 0
    # the timeline: when the test began and which worker ran it
    assert lines[0]["worker"] == ("gw0" if workers else "main"), lines
    assert before < lines[0]["start"] < time.time() - lines[0]["wall_s"] + 1, lines
