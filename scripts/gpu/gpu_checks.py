"""The runners of the checks that follow the A/B matrix: save at step k and resume to 2k (d),
``--init_from_hf`` TE vs HF (e), and one profiled configuration (where the time goes)."""

from __future__ import annotations

import shlex
import shutil
import time
from pathlib import Path

import gpu_records
import gpu_units
from gpu_context import Context, failure, fresh_dir, slug
from gpu_steps import demo_data, pytest_cmd, pytest_env

from llama_fp8.report import trace as gpu_trace

HERE = Path(__file__).resolve().parent
HF_INIT_REL_TOL = 0.01  # BF16 forward of the same weights through two implementations: losses within 1 %
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


# --- e: --init_from_hf, TE vs HF -------------------------------------------------------------------------
def checkpoint_cmd(ctx: Context, root: Path) -> list[str]:
    return [ctx.python, str(HERE / "make_hf_checkpoint.py"), str(root / "checkpoint"), "--", *ctx.opts.hf_init_model]


def run_hf_init(ctx: Context, unit: gpu_units.Unit) -> dict:
    """The GPU test that compares TE and HF logits at 4096 tokens through the build path (run by node id, or
    its record taken when pytest/te ran it already), then a full-size smoke run of the CLI path."""
    deadline = time.monotonic() + unit.timeout_s
    test = logits_test(ctx, unit, deadline)
    smoke = cli_smoke(ctx, unit, deadline)
    parts = (test["status"], smoke["status"])
    status = next((s for s in ("interrupted", "timeout", "error", "failed") if s in parts), "passed")
    message = "; ".join(f"{name}: {p.get('message', '')[:300]}" for name, p in (("test", test), ("smoke", smoke))
                        if p["status"] != "passed")
    return {**unit.info, "test": test, "smoke": smoke, "status": status, **({"message": message} if message else {})}


def logits_test(ctx: Context, unit: gpu_units.Unit, deadline: float) -> dict:
    import pytest_record

    nodeid, current = gpu_units.HF_INIT_TEST, ctx.work / f"{slug(unit.id)}.current"
    out, killed = ctx.run(f"{slug(unit.id)}_test", pytest_cmd(ctx, ["-m", "gpu", nodeid]), deadline,
                          pytest_env(ctx, current))
    if killed:
        return {"nodeid": nodeid, **failure(out, killed, "the logits test")}
    recs = [r for r in ctx.store.records() if r.get("key") == ctx.key and r.get("unit") == pytest_record.unit_of(nodeid)]
    if not recs:
        return {"nodeid": nodeid, "status": "error", "message": f"pytest exit {out.returncode}: {nodeid} did not run "
                f"(renamed? update gpu_units.HF_INIT_TEST)\n{out.tail(1000)}"}
    rec = recs[-1]
    # a skip verifies nothing: counted as failed, so that --retry runs it again
    return {"nodeid": nodeid, "test_status": rec["status"], "status": "passed" if rec["status"] == "passed" else
            "failed", "message": rec.get("message", "")[:1000]}


def cli_smoke(ctx: Context, unit: gpu_units.Unit, deadline: float) -> dict:
    """A save_pretrained checkpoint of the full model (random weights) loaded with --init_from_hf by both
    implementations, three steps at learning rate 0: both load it and run, and their losses agree. With
    random weights the loss hardly depends on how they are placed, so this checks loading at full size; the
    logits test is the TE vs HF comparison."""
    root = fresh_dir(ctx.work / "runs" / slug(unit.id))
    make = checkpoint_cmd(ctx, root)
    out, killed = ctx.run(f"{slug(unit.id)}_checkpoint", make, deadline)
    commands = {"checkpoint": shlex.join(make)}
    if killed or out.returncode != 0:
        return {"commands": commands, **failure(out, killed, "save_pretrained")}
    losses = {}
    for impl in ("hf", "te"):
        cmd = ctx.train_cmd(gpu_units.hf_init_flags(ctx.opts, impl, root / "checkpoint", root / f"run_{impl}"))
        commands[impl] = shlex.join(cmd)
        out, killed = ctx.run(f"{slug(unit.id)}_{impl}", cmd, deadline)
        if killed or out.returncode != 0:
            shutil.rmtree(root / "checkpoint", ignore_errors=True)
            return {"commands": commands, **failure(out, killed, f"--init_from_hf with {impl}")}
        losses[impl] = gpu_records.losses_by_step(root / f"run_{impl}")
    shutil.rmtree(root / "checkpoint", ignore_errors=True)  # GBs: not kept
    gap = gpu_records.max_gap(losses["te"], losses["hf"], range(1, 4))
    flags = ctx.opts.hf_init_model
    ok = gap is not None and gap[1] <= HF_INIT_REL_TOL
    return {"commands": commands, "losses": {k: sorted(v.items()) for k, v in losses.items()},
            "seq_len": flags[flags.index("--max_context_width") + 1] if "--max_context_width" in flags else None,
            "tolerance": HF_INIT_REL_TOL, "gap_abs": gap and gap[0], "gap_rel": gap and gap[1],
            "status": "passed" if ok else "failed",
            **({} if ok else {"message": f"TE vs HF loss gap {gap and gap[1]} > {HF_INIT_REL_TOL}"})}


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


