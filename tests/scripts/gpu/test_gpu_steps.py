"""The runners of verify's steps: pytest with per-test records (and a test killed half-way), bench_linear's JSON
line, the profile step (gated on the trainer's flags; its trace parsed) through the real trainer on CPU. Where a GPU program would run, a small fake stands in for it (named in each test)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import runs
import steps
import units
import verify

from report.test_trace import EVENTS

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
def test_pytest_step_records_each_test_and_goes_on_after_one_that_hangs(tmp_path):
    tests = tmp_path / "gpu_tests"
    tests.mkdir()
    (tests / "test_fake_gpu.py").write_text(textwrap.dedent("""\
        import time, pytest
        pytestmark = pytest.mark.gpu
        def test_a(): pass
        def test_b(): assert 1 == 2, "wrong"
        def test_c(): pytest.skip("needs Blackwell")
        def test_d(): time.sleep(120)
        def test_e(): pass
        """))
    (tests / "test_plain.py").write_text("def test_plain():\n    pass\n")  # no gpu marker: deselected by -m gpu
    ctx = context(tmp_path)
    unit = units.Unit("pytest/fake", "pytest", 10, 12, {"args": [str(tests)]})
    first = steps.run_pytest(ctx, unit)
    assert first["status"] == "timeout" or first["status"] == "interrupted"
    by_test = {r["nodeid"].split("::")[1]: r for r in ctx.store.records()}
    assert {k: r["status"] for k, r in by_test.items()} == {"test_a": "passed", "test_b": "failed",
                                                            "test_c": "skipped", "test_d": "timeout"}
    assert "wrong" in by_test["test_b"]["message"] and by_test["test_c"]["message"] == "Skipped: needs Blackwell"
    second = steps.run_pytest(ctx, units.Unit("pytest/fake", "pytest", 10, 120, {"args": [str(tests)]}))
    records = ctx.store.records()
    assert [r["nodeid"].split("::")[1] for r in records[4:]] == ["test_e"]  # only what was left
    assert second["status"] == "failed" and second["counts"] == {"passed": 2, "failed": 1, "skipped": 1,
                                                                  "timeout": 1}


def test_a_test_file_that_does_not_import_is_an_error_record(tmp_path):
    tests = tmp_path / "gpu_tests"
    tests.mkdir()
    (tests / "test_broken.py").write_text("import no_such_module_here\n")
    ctx = context(tmp_path)
    result = steps.run_pytest(ctx, units.Unit("pytest/broken", "pytest", 10, 120, {"args": [str(tests)]}))
    [rec] = ctx.store.records()
    assert rec["status"] == "error" and rec["phase"] == "collect" and "no_such_module_here" in rec["message"]
    assert result["status"] in ("error", "failed")


def test_bench_step_keeps_the_json_line(tmp_path):
    """Fake bench_linear.py: prints its table and JSON line as on a GPU."""
    line = {"type": "bench_linear", "device": "NVIDIA H100 80GB HBM3", "tokens": 8192,
            "results": [{"model": "llama3.1-8b", "gemm": "o", "m": 8192, "k": 4096, "n": 4096, "bf16": 610.5,
                         "te-current": 1010.2, "torchao-tensorwise": 905.0}]}
    models = ",".join(steps.bench_models(verify.REPO))
    assert {"llama3.1-8b", "llama3.1-70b", "llama3.2-1b", "llama2-7b"} <= set(models.split(","))
    python = fake_program(tmp_path, f"""\
        assert argv[0] == "benchmarks/bench_linear.py" and argv[argv.index("--tokens") + 1] == "8192", argv
        assert argv[argv.index("--models") + 1] == {models!r}, argv  # every model of bench_linear's SHAPES
        print("model gemm ...")
        print({json.dumps(json.dumps(line))})
        """)
    ctx = context(tmp_path, python)
    [unit] = [u for u in units.plan(ctx.opts) if u.id == "bench/te-current+torchao-tensorwise"]
    rec = steps.run_bench(ctx, unit)
    assert rec["status"] == "passed" and rec["bench"] == line and rec["te_recipe"] == "current"
    python = fake_program(tmp_path, "print('bench_linear: no CUDA GPU visible')\n")
    assert steps.run_bench(context(tmp_path, python), unit)["status"] == "failed"


def test_profile_summarizes_the_trace(tmp_path):
    """Fake trainer run: writes metrics, a Chrome trace (the synthetic one of tests/report/test_trace.py) and a
    memory snapshot into its run dir, as `--profile_steps`/`--memory_snapshot` do."""
    [unit] = [u for u in units.plan(units.Options()) if u.step == "profile"]
    python = fake_program(tmp_path, f"""\
        run = pathlib.Path(argv[argv.index("--run_dir") + 1])
        assert argv[argv.index("--profile_steps") + 1] == "21:23" and argv[argv.index("--memory_snapshot") + 1] == "1"
        meta = {{"type": "meta", "precision": "fp8-te-current", "model": "llama3.2-1b", "world_size": 1,
                "seq_len": 4096, "global_batch_size": 2, "flops_per_token": 1e10, "peak_tflops_bf16": 989.4,
                "peak_tflops_fp8": 1978.9, "start_step": 0}}
        rows = [meta] + [{{"type": "train", "step": s, "loss": 5.0, "elapsed_s": s * 0.5}} for s in range(5, 26, 5)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
        (run / "profile").mkdir()
        (run / "profile" / "rank0.trace.json").write_text(json.dumps({{"traceEvents": {json.dumps(EVENTS)}}}))
        (run / "memory_snapshot.pickle").write_bytes(b"x")
        """)
    ctx = context(tmp_path, python, mirror=tmp_path / "out")
    rec = steps.run_profile(ctx, unit)
    assert rec["status"] == "passed", rec
    assert rec["summary"]["share"]["gemm"] == pytest.approx(0.49) and rec["snapshots"] == ["memory_snapshot.pickle (0.0 MiB)"]
    assert rec["trace"] == "profile/rank0.trace.json" and rec["timed_steps"] == 15
    assert (tmp_path / "out" / rec["trace_kept"]).is_file() and rec["trace_kept"].endswith(".trace.json.gz")


def test_only_the_pytest_step_has_the_scripts_folder_on_its_path(tmp_path):
    """scripts/gpu's module names are plain (runs, steps, units, ...): the trainer and the benchmark must not find
    them ahead of the installed packages; pytest needs the folder for its recording plugin (-p runs)."""
    import os

    ctx = context(tmp_path)
    here = str(Path(steps.__file__).resolve().parent)
    assert here not in ctx.env["PYTHONPATH"].split(os.pathsep)
    assert str(verify.REPO / "src") in ctx.env["PYTHONPATH"].split(os.pathsep)
    env = {**ctx.env, **steps.pytest_env(ctx, tmp_path / "current")}
    assert env["PYTHONPATH"].split(os.pathsep) == [here, *ctx.env["PYTHONPATH"].split(os.pathsep)]
