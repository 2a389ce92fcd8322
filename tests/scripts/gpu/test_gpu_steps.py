"""The pytest step of verify: per-test records from pytest's own JUnit XML, a run cut off by its limit, the next run
going on with the rest, a test file that does not import."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import runs
import steps
import units
import verify

KEY = "test-gpu-0000"


def context(tmp_path: Path, python: str = sys.executable, opts: units.Options | None = None,
            mirror: Path | None = None) -> runs.Context:
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    return runs.Context(verify.REPO, work, python, runs.Store(tmp_path / "results.jsonl", mirror), KEY,
                        "NVIDIA H100 80GB HBM3", opts or units.Options(), verify.child_env(work), runs.Budget(None),
                        mirror)


def fake_program(tmp_path: Path, body: str) -> str:
    """An executable standing in for the node's Python (argv as it would get it)."""
    path = tmp_path / "fake_python"
    path.write_text(f"#!{sys.executable}\nimport json, sys, pathlib\nargv = sys.argv[1:]\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


@pytest.mark.slow
def test_pytest_step_records_each_test_and_the_next_run_goes_on_with_the_rest(tmp_path):
    """One record per test (from pytest's JUnit XML), the outcome counts over the set; a run cut off by its time
    limit records nothing of that run and the next run goes on, deselecting what is recorded."""
    tests = tmp_path / "gpu_tests"
    tests.mkdir()
    (tests / "test_fake_gpu.py").write_text(textwrap.dedent("""\
        import os, time, pytest
        pytestmark = pytest.mark.gpu
        def test_a(): pass
        def test_b(): assert 1 == 2, "wrong"
        def test_c(): pytest.skip("needs Blackwell")
        class TestGroup:
            def test_d(self): pass
        def test_slow():
            if os.environ.get("SLOW"):
                time.sleep(120)
        """))
    (tests / "test_plain.py").write_text("def test_plain():\n    pass\n")  # no gpu marker: deselected by -m gpu
    ctx = context(tmp_path)
    ctx.repo = tmp_path  # the tests' repository: node ids relative to it, as the real ones are to this one
    unit = units.Unit("pytest/fake", "pytest", 10, 120, {"args": [str(tests)]})
    ctx.env["SLOW"] = "1"
    cut = steps.run_pytest(ctx, units.Unit("pytest/fake", "pytest", 10, 8, {"args": [str(tests)]}))
    assert cut["status"] == "timeout" and ctx.store.records() == []
    del ctx.env["SLOW"]
    first = steps.run_pytest(ctx, unit)
    by_test = {r["nodeid"].split("::", 1)[1]: r for r in ctx.store.records()}
    assert {k: r["status"] for k, r in by_test.items()} == {"test_a": "passed", "test_b": "failed",
                                                            "test_c": "skipped", "TestGroup::test_d": "passed",
                                                            "test_slow": "passed"}
    assert "wrong" in by_test["test_b"]["message"] and by_test["test_c"]["message"] == "needs Blackwell"
    assert by_test["test_a"]["file"] == str(tests / "test_fake_gpu.py")
    assert first["status"] == "failed" and first["counts"] == {"passed": 3, "failed": 1, "skipped": 1}
    again = steps.run_pytest(ctx, unit)  # everything recorded: pytest deselects it all (exit 5), no new record
    assert again["returncode"] == 5 and len(ctx.store.records()) == 5 and again["counts"] == first["counts"]


def test_a_test_file_that_does_not_import_is_an_error_record(tmp_path):
    tests = tmp_path / "gpu_tests"
    tests.mkdir()
    (tests / "test_broken.py").write_text("import no_such_module_here\n")
    ctx = context(tmp_path)
    result = steps.run_pytest(ctx, units.Unit("pytest/broken", "pytest", 10, 120, {"args": [str(tests)]}))
    [rec] = ctx.store.records()
    assert rec["status"] == "error" and "no_such_module_here" in rec["message"]
    assert result["status"] in ("error", "failed")


def test_no_step_has_the_scripts_folder_on_its_path(tmp_path):
    """scripts/gpu's module names are plain (runs, steps, units, ...): the trainer and pytest must not find them
    ahead of the installed packages."""
    import os

    ctx = context(tmp_path)
    here = str(Path(steps.__file__).resolve().parent)
    assert here not in ctx.env["PYTHONPATH"].split(os.pathsep)
    assert str(verify.REPO / "src") in ctx.env["PYTHONPATH"].split(os.pathsep)
    cmd = steps.pytest_cmd(ctx, ["tests/x.py"], tmp_path / "j.xml", ("tests/x.py::test_done",))
    assert "--deselect=tests/x.py::test_done" in cmd and f"--junitxml={tmp_path / 'j.xml'}" in cmd
    assert "-p" not in cmd[cmd.index("tests/x.py"):cmd.index("no:cacheprovider") - 1]  # no plugin of ours
