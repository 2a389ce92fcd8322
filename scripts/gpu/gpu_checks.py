"""The runners of the checks that follow the A/B matrix: save at step k and resume to 2k, and one profiled
configuration (where the time goes). TE vs HF logits through ``--init_from_hf`` is a GPU test, run with the
first visit's TE value tests."""

from __future__ import annotations

import shlex
import shutil
import time
from pathlib import Path

import gpu_records
import gpu_units
from gpu_context import Context, failure, fresh_dir, slug
from gpu_steps import demo_data

from llama_fp8.report import trace as gpu_trace

HERE = Path(__file__).resolve().parent
MIRROR_TRACE_MAX = 15 * 2**20  # keep each file the output folder carries back small (16 MiB)


# --- d: save at k, resume to 2k --------------------------------------------------------------------------
def run_resume(ctx: Context, unit: gpu_units.Unit) -> dict:
    deadline = time.monotonic() + unit.timeout_s
    variant = gpu_units.VARIANT[unit.info["variant"]]
    root = fresh_dir(ctx.work / "runs" / slug(unit.id))
    commands = {}
    for phase in ("u1", "u2", "p1", "p2"):
        cmd = ctx.train_cmd(gpu_units.resume_flags(ctx.opts, variant, root / phase, phase, root / "ckpt"))
        commands[phase] = shlex.join(cmd)
        out, killed = ctx.run(f"{slug(unit.id)}_{phase}", cmd, deadline)
        if killed or out.returncode != 0:
            shutil.rmtree(root / "ckpt", ignore_errors=True)
            return {**unit.info, "commands": commands, **failure(out, killed, f"resume run {phase}")}
    try:
        result = gpu_records.compare_resume(root / "u1", root / "u2", root / "p1", root / "p2", ctx.opts.resume_k)
    except gpu_records.MetricsError as e:
        result = {"status": "error", "message": str(e)}
    shutil.rmtree(root / "ckpt", ignore_errors=True)  # GBs of optimizer state: not kept
    return {**unit.info, "commands": commands, **result}


# --- profile ---------------------------------------------------------------------------------------------
def trainer_has_flags(ctx: Context, flags: tuple[str, ...], deadline: float) -> list[str]:
    """Which of ``flags`` ``llama_fp8 train --help`` does not list."""
    if "help" not in ctx.cache:
        out, _ = ctx.run("train_help", ctx.train_cmd(["--help"]), deadline)
        ctx.cache["help"] = out.tail(200_000)
    return [f for f in flags if f not in ctx.cache["help"]]


def run_profile(ctx: Context, unit: gpu_units.Unit) -> dict:
    deadline = time.monotonic() + unit.timeout_s
    missing = trainer_has_flags(ctx, ("--profile_steps", "--memory_snapshot"), deadline)
    if missing:
        return {**unit.info, "status": "unavailable", "message": f"the trainer lacks {', '.join(missing)}"}
    demo = None
    if unit.info["cell"].split("/")[1] == "text":
        demo = demo_data(ctx, deadline)
        if isinstance(demo, str):
            return {**unit.info, "status": "unavailable", "message": demo}
    run_dir = fresh_dir(ctx.work / "runs" / slug(unit.id))
    cmd = ctx.train_cmd(gpu_units.profile_flags(ctx.opts, run_dir, demo))
    out, killed = ctx.run(slug(unit.id), cmd, deadline)
    base = {**unit.info, "command": shlex.join(cmd), "profile_steps": ctx.opts.profile_steps}
    if killed or out.returncode != 0:
        return {**base, **failure(out, killed, "profiled run")}
    traces = gpu_trace.find_traces(run_dir)
    snapshots = sorted(f"{p.relative_to(run_dir)} ({p.stat().st_size / 2**20:.1f} MiB)" for p in run_dir.rglob("*.pickle"))
    if not traces:
        return {**base, "status": "failed", "message": f"no Chrome trace under {run_dir}", "snapshots": snapshots}
    summary = gpu_trace.summarize(gpu_trace.load(traces[-1]))
    kept = keep_trace(ctx, unit, traces[-1])
    return {**base, "status": "passed", "trace": str(traces[-1].relative_to(run_dir)), "trace_kept": kept,
            "snapshots": snapshots, "summary": summary, **gpu_records.summarize(run_dir, ctx.opts.warmup)}


def keep_trace(ctx: Context, unit: gpu_units.Unit, trace: Path) -> str | None:
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


