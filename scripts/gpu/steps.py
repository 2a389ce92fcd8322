"""The runners of verify.py's steps: ``pytest -m gpu`` and the training A/B matrix. Each takes the visit's Context
and a Unit and returns the record's fields (``status`` and the numbers); every command is time-boxed by Context.run.
A run's numbers are the A/B report's (``llama_fp8.report.compare.summarize_run``: each rate over the logged windows
after the warm-up as work / time), read by ``llama_fp8.report.runs.load_run``.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import time
from collections import Counter
from pathlib import Path

import memory
import runs
import units
from runs import Context, failure, fresh_dir, slug


# --- pytest -m gpu ------------------------------------------------------------------------------------
def pytest_cmd(ctx: Context, args: list[str], junit: Path | None = None, skip: tuple[str, ...] = ()) -> list[str]:
    """pytest on ``args``, its outcomes in JUnit XML (xunit1: each test's file), the tests recorded for this key
    deselected; with pytest-timeout (the node has it) a hung test fails alone."""
    cmd = [ctx.python, "-m", "pytest", *args, "-p", "no:cacheprovider", "-q", "-rs", "-o", "junit_family=xunit1",
           f"--rootdir={ctx.repo}",  # the node ids and the XML's file names: relative to the repository
           *([f"--junitxml={junit}"] if junit else []), *[f"--deselect={n}" for n in skip]]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append("--timeout=300")
    return cmd


def junit_records(path: Path, root: Path) -> list[dict]:
    """One record per test case of a JUnit XML file (pytest's, xunit1): its node id, status, seconds, message."""
    import xml.etree.ElementTree as ET

    out = []
    for case in ET.parse(path).iter("testcase") if path.is_file() else ():
        file, parts = case.get("file", ""), case.get("classname", "").split(".")
        stem = max((i for i, x in enumerate(parts) if x == Path(file).stem), default=len(parts))  # the module's name
        nodeid = "::".join(x for x in (file, *parts[stem + 1:], case.get("name", "")) if x)
        found = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        status = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(getattr(found, "tag", ""), "passed")
        text = [] if found is None else [found.get("message"), None if status == "skipped" else found.text]
        message = "\n".join(x for x in text if x)[-2000:]
        out.append({"unit": f"test:{nodeid}", "kind": "test", "nodeid": nodeid, "file": str((root / file).resolve()),
                    "status": status, "seconds": round(float(case.get("time") or 0), 2), "message": message})
    return out


def run_pytest(ctx: Context, unit: units.Unit) -> dict:
    junit = fresh_dir(ctx.work / "junit") / f"{slug(unit.id)}.xml"
    tests = [r for r in ctx.store.records() if r.get("key") == ctx.key and r.get("kind") == "test"
             and in_test_set(r.get("file", ""), unit.info["args"], ctx.repo)]
    recorded = runs.done(tests, ctx.key, ctx.retry)
    cmd = pytest_cmd(ctx, ["-m", "gpu", *unit.info["args"]], junit, tuple(sorted(u[5:] for u in recorded)))
    out, killed = ctx.run(slug(unit.id), cmd, time.monotonic() + unit.timeout_s)
    for rec in junit_records(junit, ctx.repo):  # written by pytest when it ends: nothing of a killed run
        tests.append(ctx.store.append({"key": ctx.key, "gpu": ctx.gpu, **rec}))
    counts = dict(Counter(r["status"] for r in {r["unit"]: r for r in tests}.values()))
    base = {"command": shlex.join(cmd), "returncode": out.returncode, "counts": counts}
    if killed:  # not final: the next run goes on with the tests not recorded
        return {**base, "status": killed if killed == "timeout" else "interrupted",
                "message": f"pytest killed ({killed}) after {out.seconds:.0f} s\n{out.tail(1500)}"}
    if out.returncode not in (0, 1, 5):  # 5: nothing left to run (all recorded already); 2-4: pytest itself
        return {**base, "status": "error", "message": out.tail()}
    bad = sum(counts.get(s, 0) for s in ("failed", "error"))
    return {**base, "status": "failed" if bad else "passed",
            **({"message": f"{bad} tests failed or errored (see their records)"} if bad else {})}


def in_test_set(file: str, args: list[str], cwd: Path) -> bool:
    """Whether a test file lies under the pytest arguments' paths (minus their --ignore=PATH)."""
    def under(path: str) -> bool:
        return Path(file).is_relative_to((cwd / path).resolve())

    paths = [a.split("::")[0] for a in args if not a.startswith("-")]  # a node id's file
    ignored = [a.split("=", 1)[1] for a in args if a.startswith("--ignore=")]
    return bool(file) and any(map(under, paths)) and not any(map(under, ignored))


# --- the training A/B matrix --------------------------------------------------------------------------
def run_train(ctx: Context, unit: units.Unit) -> dict:
    deadline = time.monotonic() + unit.timeout_s
    info = unit.info
    variant = units.VARIANT[info["variant"]]
    run_dir = fresh_dir(ctx.work / "runs" / slug(unit.id))
    model, ran, rehearsal = info["model"], variant, {}
    if ctx.opts.rehearse:
        model, ran = units.rehearsal_twin(variant)
        rehearsal = {"rehearsal": {"device": "cpu", "model": model, "ran_as": ran.name}}
    cmd = ctx.train_cmd(units.train_flags(ctx.opts, model, ran, run_dir, info.get("seed", units.SEED)))
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


class MetricsError(ValueError):
    pass


THROUGHPUT = ("samples_per_sec", "tokens_per_sec_per_device", "tflops_per_device", "mfu_vs_bf16_peak",
              "mfu_vs_fp8_peak")
META_KEEP = ("precision", "model_impl", "device_name", "peak_tflops_bf16", "peak_tflops_fp8", "seq_len",
             "global_batch_size", "flops_per_token", "num_params", "world_size", "fp8_emulated", "start_step")


def load(run_dir: Path):
    """The run as the A/B report reads it (``llama_fp8.report.runs.load_run``)."""
    from llama_fp8.report.runs import CompareError, load_run

    if not (run_dir / "metrics.jsonl").is_file():
        raise MetricsError(f"{run_dir / 'metrics.jsonl'}: no metrics file (the run wrote none)")
    try:
        return load_run(str(run_dir / "metrics.jsonl"), "run")
    except CompareError as e:
        raise MetricsError(str(e)) from None


def summarize(run_dir: Path, warmup: int) -> dict:
    """A finished run's record fields: meta, the report's rates after ``warmup`` steps, memory, losses."""
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
            "windows": [[r["step"], r.get("samples_per_sec")] for r in timed],  # the headline's interval
            "losses": [[r["step"], r["loss"]] for r in train], "last_step": train[-1]["step"],
            "last_loss": train[-1]["loss"], "val_losses": [[r["step"], r["val_loss"]] for r in run.val],
            "fp8_check": fp8_check(run_dir)}


def fp8_check(run_dir: Path) -> dict | None:
    """The run's last FP8 check record (llama_fp8.precision.verify: coverage, GEMM kernels, problems); None: BF16."""
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
