"""The runners of the issue's first three steps: ``pytest -m gpu`` (a), ``bench_linear.py`` (b) and the
training A/B matrix (c). Each takes the visit's Context and a Unit and returns the record's fields
(``status`` and the numbers); every command is time-boxed by Context.run. Steps d, e and the profile are in
gpu_checks.py."""

from __future__ import annotations

import importlib.util
import json
import shlex
import time
from pathlib import Path

import gpu_records
import gpu_timebox
import gpu_units
import pytest_record
from gpu_context import Context, failure, fresh_dir, slug


# --- a: pytest -m gpu ------------------------------------------------------------------------------------
def pytest_cmd(ctx: Context, args: list[str]) -> list[str]:
    """pytest with the recording plugin (pytest_record.py) on ``args``."""
    cmd = [ctx.python, "-m", "pytest", *args, "-p", "pytest_record", "-p", "no:cacheprovider", "-q", "-rs"]
    if importlib.util.find_spec("pytest_timeout") is not None:  # the node has it: one hung test fails alone
        cmd.append("--timeout=300")
    return cmd


def pytest_env(ctx: Context, current: Path) -> dict[str, str]:
    env = {"GPU_VERIFY_RESULTS": str(ctx.store.path), "GPU_VERIFY_KEY": ctx.key, "GPU_VERIFY_CURRENT": str(current),
           "GPU_VERIFY_RETRY": "1" if ctx.retry else "0"}
    if ctx.mirror is not None:
        env["GPU_VERIFY_MIRROR"] = str(ctx.mirror)
    return env


def run_pytest(ctx: Context, unit: gpu_units.Unit) -> dict:
    current = ctx.work / f"{slug(unit.id)}.current"
    current.unlink(missing_ok=True)
    cmd = pytest_cmd(ctx, ["-m", "gpu", *unit.info["args"]])
    out, killed = ctx.run(slug(unit.id), cmd, time.monotonic() + unit.timeout_s, pytest_env(ctx, current))
    running = pytest_record.read_current(current)
    if running:  # killed inside a test: record it, so that the next run goes on after it
        test_unit = pytest_record.unit_of(running["nodeid"])
        earlier = [r for r in ctx.store.records() if r.get("key") == ctx.key and r.get("unit") == test_unit]
        # killed by the budget: tried again next time, but only once (a test longer than any budget is a timeout)
        status = "timeout" if killed == "timeout" or earlier else "interrupted"
        ctx.store.append({"key": ctx.key, "unit": test_unit, "kind": "test", **running, "status": status,
                          "seconds": round(out.seconds, 1), "message": f"killed inside this test ({killed})",
                          "phase": "run"})
    tests = [r for r in ctx.store.records() if r.get("key") == ctx.key and r.get("kind") == "test"
             and in_test_set(r.get("file", ""), unit.info["args"], ctx.repo)]
    counts: dict[str, int] = {}
    for r in {r["unit"]: r for r in tests}.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    base = {"command": shlex.join(cmd), "returncode": out.returncode, "counts": counts}
    if killed:  # not final: the next run deselects what is recorded and goes on
        where = running["nodeid"] if running else "between tests"
        return {**base, "status": "interrupted", "message": f"pytest killed ({killed}) in {where}"}
    if out.returncode not in (0, 1, 5):  # 5: nothing left to run (all recorded already); 2-4: pytest itself
        return {**base, "status": "error", "message": out.tail()}
    bad = sum(counts.get(s, 0) for s in ("failed", "error", "timeout"))
    return {**base, "status": "failed" if bad else "passed",
            **({"message": f"{bad} tests failed, errored or timed out (see their records)"} if bad else {})}


def in_test_set(file: str, args: list[str], cwd: Path) -> bool:
    """Whether a test file lies under the pytest arguments' paths (minus their --ignore=PATH)."""
    def under(path: str) -> bool:
        return Path(file).is_relative_to((cwd / path).resolve())

    paths = [a.split("::")[0] for a in args if not a.startswith("-")]  # a node id's file
    ignored = [a.split("=", 1)[1] for a in args if a.startswith("--ignore=")]
    return bool(file) and any(map(under, paths)) and not any(map(under, ignored))


# --- b: bench_linear -------------------------------------------------------------------------------------
def bench_models(repo: Path) -> list[str]:
    """Every model whose GEMM shapes bench_linear.py lists (its SHAPES table, read without importing it): the
    benchmark then measures all of them, the issue's shapes too once that table has them."""
    import ast

    tree = ast.parse((repo / "benchmarks" / "bench_linear.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "SHAPES" for t in targets):
                return list(dict.fromkeys(ast.literal_eval(row.elts[0]) for row in node.value.elts))
    raise ValueError("benchmarks/bench_linear.py has no SHAPES table")


def bench_cmd(ctx: Context, unit: gpu_units.Unit) -> list[str]:
    models = unit.info.get("models") or ",".join(bench_models(ctx.repo))
    return [ctx.python, "benchmarks/bench_linear.py", "--tokens", str(gpu_units.TOKENS), "--te_recipe",
            unit.info["te_recipe"], "--torchao_recipe", unit.info["torchao_recipe"], "--models", models]


def run_bench(ctx: Context, unit: gpu_units.Unit) -> dict:
    cmd = bench_cmd(ctx, unit)
    out, killed = ctx.run(slug(unit.id), cmd, time.monotonic() + unit.timeout_s)
    base = {"command": shlex.join(cmd), **unit.info}
    if killed or out.returncode != 0:
        return {**base, **failure(out, killed, "bench_linear")}
    lines = [x for x in out.tail(200_000).splitlines() if x.startswith('{"type": "bench_linear"')]
    if not lines:
        return {**base, "status": "failed", "message": "no bench_linear JSON line:\n" + out.tail(1500)}
    skipped = [x for x in out.tail(200_000).splitlines() if x.startswith("[bench_linear] skipping")]
    return {**base, "status": "passed", "bench": json.loads(lines[-1]), "notes": skipped}


# --- c: the training A/B matrix --------------------------------------------------------------------------
def demo_data(ctx: Context, deadline: float) -> tuple[Path, Path] | str:
    """The demo corpus and tokenizer (built once per machine), or why it could not be built."""
    if "demo" not in ctx.cache:
        out_dir = ctx.work / "demo"
        out, killed = ctx.run("demo_data", [ctx.python, "-m", "llama_fp8.data.demo", str(out_dir)], deadline)
        ok = not killed and out.returncode == 0 and (out_dir / "stamp.json").is_file()
        ctx.cache["demo"] = (out_dir / "corpus", out_dir / "tokenizer") if ok else (
            f"the demo corpus could not be built ({killed or out.returncode}):\n{out.tail(1500)}")
    return ctx.cache["demo"]


def run_train(ctx: Context, unit: gpu_units.Unit) -> dict:
    deadline = time.monotonic() + unit.timeout_s
    info = unit.info
    variant = gpu_units.VARIANT[info["variant"]]
    demo = None
    if info["data"] == "text":
        demo = demo_data(ctx, deadline)
        if isinstance(demo, str):
            return {**info, "status": "unavailable", "message": demo}
    run_dir = fresh_dir(ctx.work / "runs" / slug(unit.id))
    cmd = ctx.train_cmd(gpu_units.train_flags(ctx.opts, info["model"], info["data"], variant, run_dir, demo))
    out, killed = ctx.run(slug(unit.id), cmd, deadline)
    base = {**info, "command": shlex.join(cmd), "seconds_total": round(out.seconds, 1)}
    return {**base, **train_outcome(out, killed, variant, run_dir, ctx.opts.warmup)}


def train_outcome(out: gpu_timebox.Outcome, killed: str | None, variant: gpu_units.Variant, run_dir: Path,
                  warmup: int) -> dict:
    """passed (with the run's numbers), refused (a refusal that was expected or allowed), failed, ..."""
    if killed:
        return failure(out, killed, "train")
    if out.returncode == 0:
        if variant.expect == "refuse":
            return {"status": "failed", "message": f"{variant.recipe} ran; it must be refused on this GPU"}
        try:
            return {"status": "passed", **gpu_records.summarize(run_dir, warmup)}
        except gpu_records.MetricsError as e:
            return {"status": "error", "message": f"{e}\n{out.tail(1500)}"}
    tail = out.tail(3000)
    error_lines = [x for x in tail.splitlines() if "error" in x.lower()]
    clean = out.returncode == 2 and "Traceback" not in tail
    if variant.expect in ("refuse", "may_refuse") and clean:
        return {"status": "refused", "returncode": 2, "message": "\n".join(error_lines[-3:]) or tail[-500:]}
    return failure(out, None, "train")

