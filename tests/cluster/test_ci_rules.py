"""Under CI=true a test whose prerequisite is missing fails instead of skipping: the Slurm cluster, and the container
kit of the container tests (before, those skipped even under CI: a CI run could land with 20 tests unrun)."""

from __future__ import annotations

import ast

import pytest
from slurm_helpers import REPO, unavailable


@pytest.mark.parametrize(("ci", "outcome"), [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_a_missing_prerequisite_fails_under_ci_and_skips_elsewhere(monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="the container kit is missing"):
        unavailable("the container kit is missing")


def test_the_container_fixture_skips_only_through_that_rule():
    tree = ast.parse((REPO / "tests" / "cluster" / "conftest.py").read_text())
    (pyxis,) = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "pyxis"]
    calls = {ast.unparse(n.func) for n in ast.walk(pyxis) if isinstance(n, ast.Call)}
    assert "unavailable" in calls and "pytest.skip" not in calls, calls
