"""The GPU visit (scripts/gpu/) runs the estimate's GPU test as a unit of its own in its `all` plan."""

from __future__ import annotations

import sys

from helpers import REPO


def test_the_gpu_visit_runs_the_estimate_gpu_test_once_as_its_own_unit(monkeypatch):
    """`pytest/estimate` runs tests/estimate/test_estimate_gpu.py (with -s: its numbers in the log), after
    `pytest/other`, which leaves that file out (a test is recorded once), and before the training matrix."""
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "gpu"))
    monkeypatch.delitem(sys.modules, "units", raising=False)
    import units

    plan = {u.id: u for u in units.plan(units.Options(), "all")}
    mine = "tests/estimate/test_estimate_gpu.py"
    assert plan["pytest/estimate"].info["args"] == [mine, "-s"] and plan["pytest/estimate"].step == "pytest"
    assert f"--ignore={mine}" in plan["pytest/other"].info["args"]
    ids = list(plan)
    matrix = ids.index("train/llama3.2-3b/synthetic/hf-bf16")
    assert ids.index("pytest/other") < ids.index("pytest/estimate") < matrix
    assert (REPO / mine).is_file()
