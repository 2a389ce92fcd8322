"""The runners of verify.py's steps: ``pytest -m gpu``, ``bench_linear.py``, the training A/B matrix and one
profiled configuration. Each takes the visit's Context and a Unit and returns
the record's fields (``status`` and the numbers); every command is time-boxed by Context.run.

A run's numbers are the report's: throughput, TFLOPS and MFU are ``llama_fp8.report.compare.summarize_run``
(what ``python -m llama_fp8 compare`` reports: each rate over the logged windows after the warm-up as work /
time, so the ratio of two runs' samples/s is the report's one speed-up), the run is read by
``llama_fp8.report.runs.load_run``, and a profile's kernel shares come from
``llama_fp8.report.trace``: a results page and an A/B report of the same run give the same numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import time
from pathlib import Path

import memory
import runs
import units
from runs import Context, failure, fresh_dir, slug

from llama_fp8.report import trace


# --- a: pytest -m gpu ------------------------------------------------------------------------------------
def pytest_cmd(ctx: Context, args: list[str]) -> list[str]:
    """pytest with the recording plugin (runs.py) on ``args``."""
    cmd = [ctx.python, "-m", "pytest", *args, "-p", "runs", "-p", "no:cacheprovider", "-q", "-rs"]
    if importlib.util.find_spec("pytest_timeout") is not None:  # the node has it: one hung test fails alone
        cmd.append("--timeout=300")
    return cmd


def pytest_env(ctx: Context, current: Path) -> dict[str, str]:
    env = {"GPU_VERIFY_RESULTS": str(ctx.store.path), "GPU_VERIFY_KEY": ctx.key, "GPU_VERIFY_GPU": ctx.gpu,
           "GPU_VERIFY_CURRENT": str(current),
           "GPU_VERIFY_RETRY": "1" if ctx.retry else "0",  # scripts/gpu for the plugin (-p runs): pytest's alone
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), ctx.env.get("PYTHONPATH")) if p)}
    if ctx.mirror is not None:
        env["GPU_VERIFY_MIRROR"] = str(ctx.mirror)
    return env


def run_pytest(ctx: Context, unit: units.Unit) -> dict:
    current = ctx.work / f"{slug(unit.id)}.current"
    current.unlink(missing_ok=True)
    cmd = pytest_cmd(ctx, ["-m", "gpu", *unit.info["args"]])
    out, killed = ctx.run(slug(unit.id), cmd, time.monotonic() + unit.timeout_s, pytest_env(ctx, current))
    running = runs.read_current(current)
    if running:  # killed inside a test: record it, so that the next run goes on after it
        test_unit = runs.unit_of(running["nodeid"])
        earlier = [r for r in ctx.store.records() if r.get("key") == ctx.key and r.get("unit") == test_unit]
        # killed by the budget: tried again next time, but only once (a test longer than any budget is a timeout)
        status = "timeout" if killed == "timeout" or earlier else "interrupted"
        ctx.store.append({"key": ctx.key, "gpu": ctx.gpu, "unit": test_unit, "kind": "test", **running, "status": status,
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


def bench_cmd(ctx: Context, unit: units.Unit) -> list[str]:
    models = unit.info.get("models") or ",".join(bench_models(ctx.repo))
    return [ctx.python, "benchmarks/bench_linear.py", "--tokens", str(units.TOKENS), "--te_recipe",
            unit.info["te_recipe"], "--torchao_recipe", unit.info["torchao_recipe"], "--models", models]


def run_bench(ctx: Context, unit: units.Unit) -> dict:
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


def run_train(ctx: Context, unit: units.Unit) -> dict:
    deadline = time.monotonic() + unit.timeout_s
    info = unit.info
    variant = units.VARIANT[info["variant"]]
    demo = None
    if info["data"] == "text":
        demo = demo_data(ctx, deadline)
        if isinstance(demo, str):
            return {**info, "status": "unavailable", "message": demo}
    run_dir = fresh_dir(ctx.work / "runs" / slug(unit.id))
    model, ran, rehearsal = info["model"], variant, {}
    if ctx.opts.rehearse:
        model, ran = units.rehearsal_twin(variant)
        rehearsal = {"rehearsal": {"device": "cpu", "model": model, "ran_as": ran.name}}
    cmd = ctx.train_cmd(units.train_flags(ctx.opts, model, info["data"], ran, run_dir, demo,
                                          info.get("seed", units.SEED)))
    with memory.SmiSampler(ctx.work / "logs" / f"{slug(unit.id)}.smi.csv") as smi:
        out, killed = ctx.run(slug(unit.id), cmd, deadline)
    base = {**info, **rehearsal, "command": shlex.join(cmd), "seconds_total": round(out.seconds, 1), **smi.fields()}
    return {**base, **train_outcome(out, killed, ran, run_dir, ctx.opts.warmup)}


def train_outcome(out: runs.Outcome, killed: str | None, variant: units.Variant, run_dir: Path,
                  warmup: int) -> dict:
    """passed (with the run's numbers), refused (a refusal that was expected or allowed), failed, ..."""
    if killed:
        return failure(out, killed, "train")
    if out.returncode == 0:
        if variant.expect == "refuse":
            return {"status": "failed", "message": f"{variant.recipe} ran; it must be refused on this GPU"}
        try:
            return {"status": "passed", **summarize(run_dir, warmup)}
        except MetricsError as e:
            return {"status": "error", "message": f"{e}\n{out.tail(1500)}"}
    tail = out.tail(3000)
    error_lines = [x for x in tail.splitlines() if "error" in x.lower()]
    clean = out.returncode == 2 and "Traceback" not in tail
    if variant.expect in ("refuse", "may_refuse") and clean:
        return {"status": "refused", "returncode": 2, "message": "\n".join(error_lines[-3:]) or tail[-500:]}
    return failure(out, None, "train")



MIRROR_TRACE_MAX = 15 * 2**20  # keep each file the output folder carries back small (16 MiB)


# --- profile ---------------------------------------------------------------------------------------------
def run_profile(ctx: Context, unit: units.Unit) -> dict:
    deadline = time.monotonic() + unit.timeout_s
    demo = None
    if unit.info["cell"].split("/")[1] == "text":
        demo = demo_data(ctx, deadline)
        if isinstance(demo, str):
            return {**unit.info, "status": "unavailable", "message": demo}
    run_dir = fresh_dir(ctx.work / "runs" / slug(unit.id))
    cmd = ctx.train_cmd(units.profile_flags(ctx.opts, run_dir, demo))
    out, killed = ctx.run(slug(unit.id), cmd, deadline)
    base = {**unit.info, "command": shlex.join(cmd), "profile_steps": ctx.opts.profile_steps}
    if killed or out.returncode != 0:
        return {**base, **failure(out, killed, "profiled run")}
    traces = trace.find_traces(run_dir)
    snapshots = sorted(f"{p.relative_to(run_dir)} ({p.stat().st_size / 2**20:.1f} MiB)" for p in run_dir.rglob("*.pickle"))
    if not traces:
        return {**base, "status": "failed", "message": f"no Chrome trace under {run_dir}", "snapshots": snapshots}
    summary = trace.summarize(trace.load(traces[-1]))
    kept = keep_trace(ctx, unit, traces[-1])
    return {**base, "status": "passed", "trace": str(traces[-1].relative_to(run_dir)), "trace_kept": kept,
            "snapshots": snapshots, "summary": summary, **summarize(run_dir, ctx.opts.warmup)}


def keep_trace(ctx: Context, unit: units.Unit, trace: Path) -> str | None:
    """Copy the trace (gzipped) next to the mirrored results when it is small enough to come back."""
    import gzip

    if ctx.mirror is None:
        return None
    ctx.mirror.mkdir(parents=True, exist_ok=True)
    dest = ctx.mirror / f"{slug(unit.id)}.trace.json.gz"
    data = trace.read_bytes()
    if not trace.name.endswith(".gz"):
        data = gzip.compress(data)
    if len(data) > MIRROR_TRACE_MAX:
        return f"not kept: {len(data) / 2**20:.0f} MiB gzipped"
    dest.write_bytes(data)
    return dest.name



class MetricsError(ValueError):
    pass


THROUGHPUT = ("samples_per_sec", "tokens_per_sec_per_device", "tflops_per_device", "mfu_vs_bf16_peak",
              "mfu_vs_fp8_peak")
META_KEEP = ("precision", "model_impl", "device_name", "peak_tflops_bf16", "peak_tflops_fp8", "seq_len",
             "global_batch_size", "flops_per_token", "num_params", "world_size", "fp8_emulated", "start_step")


def load(run_dir: Path):
    """The run as the A/B report reads it (``llama_fp8.report.runs.load_run``: one record per step)."""
    from llama_fp8.report.runs import CompareError, load_run

    if not (run_dir / "metrics.jsonl").is_file():
        raise MetricsError(f"{run_dir / 'metrics.jsonl'}: no metrics file (the run wrote none)")
    try:
        return load_run(str(run_dir / "metrics.jsonl"), "run")
    except CompareError as e:
        raise MetricsError(str(e)) from None


def summarize(run_dir: Path, warmup: int) -> dict:
    """The record fields of one finished run: meta, the report's throughput over the logged steps after
    ``warmup`` (counted from the run's start step), memory, losses per logged step."""
    from llama_fp8.report.compare import summarize_run

    run = load(run_dir)
    meta, train = run.meta, run.train
    start = meta.get("start_step") or 0
    timed = [r for r in train if r["step"] > start + warmup]
    summary = summarize_run(run, start + warmup)  # no timed steps: rates None, memory over every step
    reserved = [r["mem_reserved_peak_gib"] for r in train if r.get("mem_reserved_peak_gib") is not None]
    return {**{k: meta.get(k) for k in META_KEEP},
            "preset": meta.get("model"),  # not "model": records name the matrix model (llama2-7b-8l), not the preset
            "warmup_steps": warmup, "timed_steps": (timed[-1]["step"] - start - warmup) if timed else 0,
            **{k: summary.get(k) for k in THROUGHPUT},
            "mem_peak_gib": summary["mem_peak_gib"], "data_wait_frac": summary["data_wait_frac"],
            "mem_reserved_peak_gib": max(reserved) if reserved else None,
            "alloc_retries": max((r.get("alloc_retries", 0) for r in train), default=0),
            "losses": [[r["step"], r["loss"]] for r in train], "last_step": train[-1]["step"],
            "last_loss": train[-1]["loss"], "val_losses": [[r["step"], r["val_loss"]] for r in run.val],
            "fp8_check": fp8_check(run_dir)}


def fp8_check(run_dir: Path) -> dict | None:
    """The run's FP8 check (metrics.jsonl ``type: fp8_check``, llama_fp8.precision.verify: coverage, the GEMM
    kernels of the profiled step, problems and notes), the last one written; None for a BF16 run."""
    found = None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if '"fp8_check"' in line:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("type") == "fp8_check":
                found = {k: v for k, v in rec.items() if k != "type"}
    return found
